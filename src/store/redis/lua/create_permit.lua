#!lua
-- create_permit.lua: store a new, already validated permit.
--
-- KEYS[1]  <prefix>:{P}:permit
-- ARGV[1]  when the permit is forgotten (ms since epoch: expiry + retention;
--          lib.lua: unpin)
-- ARGV[2..] field, value, field, value, ... (see lib.lua for the fields)
--
-- Returns {"OK"}, or {"ERR", "STORE_UNAVAILABLE", message} if the id is
-- taken (ids are fresh UUIDv7s, so only a bug could cause it).
-- Example: KEYS={"atmost:{0190..}:permit"} ARGV={"1767225600000","subject","agent-7",...}

if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'ERR', 'STORE_UNAVAILABLE', 'permit ' .. string.match(KEYS[1], '{(.-)}')
    .. ' already exists: a permit id given twice'}
end
redis.call('HSET', KEYS[1], 'fa', ARGV[1], unpack(ARGV, 2))
redis.call('PEXPIREAT', KEYS[1], ARGV[1])
return {'OK'}
