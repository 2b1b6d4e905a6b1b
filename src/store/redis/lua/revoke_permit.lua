#!lua
-- revoke_permit.lua: mark a permit REVOKED. New keys stop; commits, replays,
-- MarkUncertain and Resolve of existing attempts go on. A call still
-- awaiting approval (or approved and not yet claimed) is denied
-- ("permit_revoked", now, by nobody): nothing was sent for it, and a
-- revoked permit sends nothing new; the lapses due are written first
-- (domain/ledger.rs: Ledger::revoke).
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open (unused)  KEYS[4]  <prefix>:{P}:dup (unused)
-- KEYS[5]  <prefix>:{P}:held (unused)
-- KEYS[6]  <prefix>:uncertain:{T}:t:<tenant> (unused)
-- KEYS[7]  <prefix>:uncertain:{T} (unused)
-- KEYS[8]  <prefix>:{P}:pending    KEYS[9]  <prefix>:{P}:awaiting
-- KEYS[10] <prefix>:approvals:{T}:t:<tenant>  (the approvals index's shard)
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  the caller's tenant     ARGV[3]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", hash}, hash the permit as HGETALL gives it (after the
-- change), or {"ERR", "PERMIT_NOT_FOUND"} | {"ERR", "STORE_UNAVAILABLE", why}
-- (the record, read whole, not as atmost writes it: lib.lua,
-- readable_record; a pending member that names no pending call, a record
-- or counter that cannot be read; nothing is written then; or the permit
-- gone while its attempts remain).

local now = clock(ARGV[1])
local p, refused = permit_for(KEYS, now, ARGV[2], ARGV[3], 'appr')
if refused then
  return refused
end
if not readable_record(redis.call('HGETALL', KEYS[1])) then
  return UNREADABLE_PERMIT
end
-- Every pending call: those past their deadline lapse, the others are
-- denied.
local calls, unreadable = pending_read(KEYS, p, '+')
if not calls then
  return unreadable
end
pending_write(KEYS, p, calls, now, {reason = 'permit_revoked', by = '', at = now})
redis.call('HSET', KEYS[1], 'status', STATUS_REVOKED)
return {'OK', redis.call('HGETALL', KEYS[1])}
