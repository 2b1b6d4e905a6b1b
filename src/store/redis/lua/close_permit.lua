#!lua
-- close_permit.lua: before a permit leaves the cross-permit index, close it
-- for new keys, so none can open an attempt under it afterwards whatever
-- Redis's clock does (a step back, a failover to a node whose clock is
-- behind): the index must keep every permit that may hold an open attempt.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  index margin (ms)
--
-- Returns {"OK", 1} when the permit is closed (it expired more than the
-- margin ago and has no open attempt, now or at an earlier close), so it
-- may leave the index; {"OK", 0} when it may not; or
-- {"ERR", "PERMIT_NOT_FOUND"} (gone: it may leave the index) |
-- {"ERR", "STORE_UNAVAILABLE", why}.
-- Example: ARGV={"", 60000} -> {"OK", 1}

local now = clock(ARGV[1])
local p = redis.call('HMGET', KEYS[1], 'exp', 'open', 'fa', 'closed')
if not p[1] or forgotten(p[3], p[2], now) then
  return permit_not_found(p[1], KEYS[2])
end
local exp, open = tonumber(p[1]), tonumber(p[2])
if not (exp and open) then
  return UNREADABLE_PERMIT
end
if p[4] then
  return {'OK', 1}
end
if open == 0 and now > exp + tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'closed', '1')
  return {'OK', 1}
end
return {'OK', 0}
