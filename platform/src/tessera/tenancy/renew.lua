-- Extends a running request's concurrency lease and its ticket's settle-by time (admission.lua).
-- KEYS[1] leases, KEYS[2] open tickets; ARGV: lease_id lease_ttl_s (may be fractional) ticket_member
-- Returns 1 when renewed, 0 when the lease is gone (finished, or expired and pruned by an admission). The
-- ticket is kept open as long as the gateway renews, even after its lease was pruned: the request still runs.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local ttl = tonumber(ARGV[2])
if redis.call('ZSCORE', KEYS[2], ARGV[3]) then redis.call('ZADD', KEYS[2], now + ttl, ARGV[3]) end
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  if redis.call('TTL', KEYS[1]) < math.ceil(ttl) + 1 then redis.call('EXPIRE', KEYS[1], math.ceil(ttl) + 1) end
  return 1
end
return 0
