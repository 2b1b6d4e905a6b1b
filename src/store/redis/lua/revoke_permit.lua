#!lua
-- revoke_permit.lua: mark a permit REVOKED. New keys stop; commits, replays,
-- MarkUncertain and Resolve of existing attempts go on.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  the caller's tenant     ARGV[3]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", hash}, hash the permit as HGETALL gives it (after the
-- change), or {"ERR", "PERMIT_NOT_FOUND"} | {"ERR", "STORE_UNAVAILABLE", why}.

local exp, fa, open, ten, agents = unpack(redis.call('HMGET', KEYS[1], 'exp', 'fa',
  'open', 'ten', 'agents'))
if not exp or forgotten(fa, open, clock(ARGV[1])) then
  return permit_not_found(exp, KEYS[2])
end
if not visible(ten, agents, ARGV[2], ARGV[3]) then
  return NOT_VISIBLE
end
redis.call('HSET', KEYS[1], 'status', STATUS_REVOKED)
return {'OK', redis.call('HGETALL', KEYS[1])}
