-- revoke_permit.lua: mark a permit REVOKED. New keys stop; commits, replays,
-- MarkUncertain and Resolve of existing attempts go on.
--
-- KEYS[1]  <prefix>:{P}:permit
--
-- Returns {"OK", hash}, hash the permit as HGETALL gives it (after the
-- change), or {"ERR", "PERMIT_NOT_FOUND"}.

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {'ERR', 'PERMIT_NOT_FOUND'}
end
redis.call('HSET', KEYS[1], 'status', STATUS_REVOKED)
return {'OK', redis.call('HGETALL', KEYS[1])}
