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
-- {"ERR", "STORE_UNAVAILABLE", why} (a field not as atmost writes it:
-- nothing is written; or the permit gone while its attempts remain).
-- Example: ARGV={"", 60000} -> {"OK", 1}

local now = clock(ARGV[1])
local p = read_permit(KEYS[1], 'exp', 'open', 'fa', 'closed')
if not p then
  return permit_not_found(KEYS[2])
elseif p.unreadable then
  return UNREADABLE_PERMIT
elseif forgotten(p, now) then
  return PERMIT_NOT_FOUND
end
if p.closed then
  return {'OK', 1}
end
if p.open == 0 and now > p.exp + tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'closed', '1')
  return {'OK', 1}
end
return {'OK', 0}
