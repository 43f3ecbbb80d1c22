-- Tessera admission: one atomic call per request. Redis's own clock (TIME) is the only clock, so gateway
-- clock skew cannot over-admit. Every key written here gets a TTL.
--
-- KEYS[1] rpm log    ZSET  lease_id -> admit time (s)             sliding 60 s window, exact
-- KEYS[2] tpm log    ZSET  lease_id -> admit time (s)             sliding 60 s window
-- KEYS[3] tpm tokens HASH  lease_id -> tokens charged (reserved, then actual); field "_total" = sum
-- KEYS[4] leases     ZSET  lease_id -> lease expiry (s)          concurrency; expired leases are freed
-- KEYS[5] budget     STRING tokens charged this budget period
-- KEYS[6] open       ZSET  "<tenant>:<lease_id>" -> settle-by time (s): the settler's to-do list (settlement.py)
-- KEYS[7] tickets    HASH  "<tenant>:<lease_id>" -> "reserved prompt admitted_at budget_key engine_request_id"
-- KEYS[8] done marker of this lease (finish.lua): set by a void that came first, so the admission is refused
-- ARGV: rpm_limit tpm_limit conc_limit budget_limit reserve_tokens lease_id lease_ttl_s budget_ttl_s
--       prompt_tokens engine_request_id ticket_member ticket_retention_s
--       (a limit of 0 means unlimited; lease_ttl_s may be fractional)
-- Returns {1, now_ms} when admitted, or {0, limit_name, retry_after_ms, current, limit} when rejected.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm_limit, tpm_limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local conc_limit, budget_limit = tonumber(ARGV[3]), tonumber(ARGV[4])
local reserve, lease_id = tonumber(ARGV[5]), ARGV[6]
local lease_ttl, budget_ttl = tonumber(ARGV[7]), tonumber(ARGV[8])
local window = 60
-- The gateway gave this admission up (its reply was lost) and voided it before it ran: never admit it now.
if redis.call('EXISTS', KEYS[8]) == 1 then return {0, 'voided', 0, 0, 0} end

-- Expire the sliding windows and dead leases first.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - window)
for _, id in ipairs(expired) do
  local charged = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HINCRBY', KEYS[3], '_total', -charged)
  redis.call('HDEL', KEYS[3], id)
end
if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - window) end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)

local function oldest_plus_window(key)
  local first = redis.call('ZRANGE', KEYS[key], 0, 0, 'WITHSCORES')
  if #first == 0 then return 1000 end
  return math.max(1, math.ceil((tonumber(first[2]) + window - now) * 1000))
end

if rpm_limit > 0 then
  local used = redis.call('ZCARD', KEYS[1])
  if used >= rpm_limit then return {0, 'requests_per_minute', oldest_plus_window(1), used, rpm_limit} end
end
if tpm_limit > 0 then
  local used = tonumber(redis.call('HGET', KEYS[3], '_total') or '0')
  if used + reserve > tpm_limit then
    if reserve > tpm_limit then return {0, 'tokens_per_minute', 0, reserve, tpm_limit} end
    return {0, 'tokens_per_minute', oldest_plus_window(2), used, tpm_limit}
  end
end
if conc_limit > 0 then
  local used = redis.call('ZCARD', KEYS[4])
  if used >= conc_limit then return {0, 'max_concurrent_requests', 1000, used, conc_limit} end
end
if budget_limit > 0 then
  local used = tonumber(redis.call('GET', KEYS[5]) or '0')
  if reserve > budget_limit then return {0, 'token_budget', 0, reserve, budget_limit} end
  if used + reserve > budget_limit then
    local ttl = redis.call('TTL', KEYS[5])
    if ttl < 0 then ttl = budget_ttl end
    return {0, 'token_budget', ttl * 1000, used, budget_limit}
  end
end

-- Admitted: record everything, each key with a TTL.
redis.call('ZADD', KEYS[1], now, lease_id)
redis.call('EXPIRE', KEYS[1], window + 1)
redis.call('ZADD', KEYS[2], now, lease_id)
redis.call('EXPIRE', KEYS[2], window + 1)
redis.call('HSET', KEYS[3], lease_id, reserve)
redis.call('HINCRBY', KEYS[3], '_total', reserve)
redis.call('EXPIRE', KEYS[3], window + 1)
redis.call('ZADD', KEYS[4], now + lease_ttl, lease_id)
redis.call('EXPIRE', KEYS[4], math.ceil(lease_ttl) + 1)
redis.call('INCRBY', KEYS[5], reserve)
if redis.call('TTL', KEYS[5]) < 0 then redis.call('EXPIRE', KEYS[5], budget_ttl) end
-- The ticket: what the settler needs to bill this request if its gateway never finishes it.
local member, retention = ARGV[11], tonumber(ARGV[12])
redis.call('HSET', KEYS[7], member, string.format('%d %d %.3f %s %s', reserve, tonumber(ARGV[9]), now, KEYS[5], ARGV[10]))
redis.call('EXPIRE', KEYS[7], retention)
redis.call('ZADD', KEYS[6], now + lease_ttl, member)
redis.call('EXPIRE', KEYS[6], retention)
return {1, math.floor(now * 1000)}
