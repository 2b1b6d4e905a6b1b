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
-- {"ERR", "STORE_UNAVAILABLE", why} (gone while its attempts remain).
-- Example: ARGV={""} -> {"OK", {"subject","agent-7","currency","EUR",...}}

local exp, fa, open, ten, agents = unpack(redis.call('HMGET', KEYS[1], 'exp', 'fa',
  'open', 'ten', 'agents'))
if not exp or forgotten(fa, open, clock(ARGV[1])) then
  return permit_not_found(exp, KEYS[2])
end
if not visible(ten, agents, ARGV[2], ARGV[3]) then
  return NOT_VISIBLE
end
return {'OK', redis.call('HGETALL', KEYS[1])}
