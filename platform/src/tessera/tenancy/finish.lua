-- Settles one admitted request, once: charges actual tokens instead of the reservation, frees its lease,
-- closes its ticket and adds the request to the tenant's usage of the current hour, day and month.
-- The one place that decides who bills a request: the gateway's own finish, the settler (its gateway died:
-- billed from the engine's record, or its whole reservation), or a void (the admission's reply was lost and
-- the client got an error). Whoever sets the done marker first bills it; every later call is a no-op.
-- KEYS[1..5] as in admission.lua; KEYS[6..8] usage HASHes of the hour, day and month; KEYS[9] done marker;
-- KEYS[10] open tickets ZSET, KEYS[11] tickets HASH (admission.lua).
-- ARGV: lease_id reserved_tokens actual_tokens prompt_tokens completion_tokens
--       usage_ttl_hour_s usage_ttl_day_s usage_ttl_month_s done_ttl_s kind ticket_member
--       kind: 'gateway' | 'engine' (settler, engine's record) | 'reservation' (settler, no record) | 'void'
-- Returns 1 when billed (or voided) now, 0 when this lease was already billed.
local lease_id, reserved, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local prompt_tokens, completion_tokens = tonumber(ARGV[4]), tonumber(ARGV[5])
local kind, member = ARGV[10], ARGV[11]
local open = redis.call('HEXISTS', KEYS[11], member) == 1
-- The settler bills only an open ticket: one closed meanwhile was billed by its gateway (whose marker may
-- be gone by now). A gateway's own finish needs no ticket: a Redis that lost it must not lose the usage too.
if (kind == 'engine' or kind == 'reservation') and not open then return 0 end
if not redis.call('SET', KEYS[9], '1', 'NX', 'EX', tonumber(ARGV[9])) then return 0 end
redis.call('ZREM', KEYS[10], member)
redis.call('HDEL', KEYS[11], member)
redis.call('ZREM', KEYS[4], lease_id)
local budget_exists = redis.call('EXISTS', KEYS[5]) == 1
if kind == 'void' then
  -- Nothing was served: undo what the admission recorded, if it ran (its ticket says so). Nothing goes to usage.
  if not open then return 1 end
  redis.call('ZREM', KEYS[1], lease_id)
  redis.call('ZREM', KEYS[2], lease_id)
  local charged = redis.call('HGET', KEYS[3], lease_id)
  if charged then
    redis.call('HDEL', KEYS[3], lease_id)
    redis.call('HINCRBY', KEYS[3], '_total', -tonumber(charged))
  end
  if budget_exists then redis.call('DECRBY', KEYS[5], reserved) end
  return 1
end
-- Never charge beyond what was admitted: the reservation is prompt + max_tokens x n, so more than it means a
-- fault upstream (a failover that restarted generation), not the tenant's usage. A lease admitted without
-- Redis (fail-open) reserved nothing and is charged what it reports.
if reserved > 0 and actual > reserved then
  actual = reserved
  completion_tokens = math.max(0, reserved - prompt_tokens)
end
local delta = actual - reserved
-- The TPM entry may already have left the window: then there is nothing to correct there.
local charged = redis.call('HGET', KEYS[3], lease_id)
if charged then
  redis.call('HSET', KEYS[3], lease_id, actual)
  redis.call('HINCRBY', KEYS[3], '_total', actual - tonumber(charged))
end
-- The budget key has the period's TTL; when the period ended meanwhile it is gone, and INCRBY would
-- recreate it without one.
if budget_exists then
  redis.call('INCRBY', KEYS[5], delta)
end
for i = 6, 8 do
  redis.call('HINCRBY', KEYS[i], 'requests', 1)
  redis.call('HINCRBY', KEYS[i], 'prompt_tokens', prompt_tokens)
  redis.call('HINCRBY', KEYS[i], 'completion_tokens', completion_tokens)
  -- Labels: requests the settler billed after their gateway died, from the engine's count or in full.
  if kind == 'engine' then redis.call('HINCRBY', KEYS[i], 'settled_from_engine', 1) end
  if kind == 'reservation' then
    redis.call('HINCRBY', KEYS[i], 'charged_reservation', 1)
    redis.call('HINCRBY', KEYS[i], 'charged_reservation_tokens', actual)
  end
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[i]))
end
return 1
