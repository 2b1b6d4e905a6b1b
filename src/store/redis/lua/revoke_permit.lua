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
-- change), or {"ERR", "PERMIT_NOT_FOUND"} | {"ERR", "STORE_UNAVAILABLE", why}
-- (the record, read whole, not as atmost writes it: lib.lua,
-- readable_record; nothing is written then; or the permit gone while its
-- attempts remain).

local _, refused = permit_for(KEYS, clock(ARGV[1]), ARGV[2], ARGV[3])
if refused then
  return refused
end
if not readable_record(redis.call('HGETALL', KEYS[1])) then
  return UNREADABLE_PERMIT
end
redis.call('HSET', KEYS[1], 'status', STATUS_REVOKED)
return {'OK', redis.call('HGETALL', KEYS[1])}
