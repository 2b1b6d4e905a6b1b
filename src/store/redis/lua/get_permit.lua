#!lua flags=no-writes
-- get_permit.lua: a permit and its usage, as stored.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  the caller's tenant     ARGV[3]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", hash}, hash the permit as HGETALL gives it, or
-- {"ERR", "PERMIT_NOT_FOUND"} (none, or forgotten: lib.lua, forgotten) |
-- {"ERR", "STORE_UNAVAILABLE", why} (the record, read whole, not as atmost
-- writes it: lib.lua, readable_record; or gone while its attempts remain).
-- Example: ARGV={""} -> {"OK", {"subject","agent-7","currency","EUR",...}}

local _, refused = permit_for(KEYS, clock(ARGV[1]), ARGV[2], ARGV[3])
if refused then
  return refused
end
local hash = redis.call('HGETALL', KEYS[1])
if not readable_record(hash) then
  return UNREADABLE_PERMIT
end
return {'OK', hash}
