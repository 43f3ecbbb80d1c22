-- Whether any open ticket is past its settle-by time by at least the grace (Redis's clock, as due_tickets reads
-- it): the settler's pass asks this first, in one round trip, and takes its lock only when the answer is 1.
-- KEYS[1] the open tickets (a sorted set scored by settle-by time, seconds); ARGV[1] the grace, seconds.
local now = redis.call('TIME')
local cutoff = tonumber(now[1]) + tonumber(now[2]) / 1e6 - tonumber(ARGV[1])
return #redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff, 'LIMIT', 0, 1)
