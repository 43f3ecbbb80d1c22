-- Extends a running request's concurrency lease. KEYS[1] leases; ARGV: lease_id lease_ttl_s
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
  redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]) + 1)
  return 1
end
return 0
