-- Reconciles one admitted request: charge actual tokens instead of the reservation, free its lease.
-- KEYS[1..5] as in admission.lua, KEYS[6] usage HASH of the period.
-- ARGV: lease_id reserved_tokens actual_tokens prompt_tokens completion_tokens usage_ttl_s
local lease_id, reserved, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local delta = actual - reserved
-- The TPM entry may already have left the window: then there is nothing to correct there.
local charged = redis.call('HGET', KEYS[3], lease_id)
if charged then
  redis.call('HSET', KEYS[3], lease_id, actual)
  redis.call('HINCRBY', KEYS[3], '_total', delta)
end
if redis.call('EXISTS', KEYS[5]) == 1 then
  redis.call('INCRBY', KEYS[5], delta)
end
redis.call('ZREM', KEYS[4], lease_id)
redis.call('HINCRBY', KEYS[6], 'requests', 1)
redis.call('HINCRBY', KEYS[6], 'prompt_tokens', tonumber(ARGV[4]))
redis.call('HINCRBY', KEYS[6], 'completion_tokens', tonumber(ARGV[5]))
redis.call('EXPIRE', KEYS[6], tonumber(ARGV[6]))
return 1
