-- Reconciles one admitted request: charge actual tokens instead of the reservation, free its lease, and add
-- the request to the tenant's usage of the current hour, day and month. Idempotent: a retried finish (the
-- gateway retries when Redis did not answer) is a no-op, so usage is counted once.
-- KEYS[1..5] as in admission.lua; KEYS[6..8] usage HASHes of the hour, day and month; KEYS[9] done marker.
-- ARGV: lease_id reserved_tokens actual_tokens prompt_tokens completion_tokens
--       usage_ttl_hour_s usage_ttl_day_s usage_ttl_month_s done_ttl_s
-- Returns 1 when reconciled now, 0 when this lease was already finished.
local lease_id, reserved, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local prompt_tokens, completion_tokens = tonumber(ARGV[4]), tonumber(ARGV[5])
if not redis.call('SET', KEYS[9], '1', 'NX', 'EX', tonumber(ARGV[9])) then return 0 end
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
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('INCRBY', KEYS[5], delta)
end
redis.call('ZREM', KEYS[4], lease_id)
for i = 6, 8 do
  redis.call('HINCRBY', KEYS[i], 'requests', 1)
  redis.call('HINCRBY', KEYS[i], 'prompt_tokens', prompt_tokens)
  redis.call('HINCRBY', KEYS[i], 'completion_tokens', completion_tokens)
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[i]))
end
return 1
