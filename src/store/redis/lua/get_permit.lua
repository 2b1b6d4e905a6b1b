#!lua flags=no-writes
-- get_permit.lua: a permit and its usage, as every reader sees it at `now`:
-- the slots and costs of pending calls past their deadline (DENIED for
-- every reader, their lapse not yet written) are not held (domain/ledger.rs:
-- Ledger::view). Reads only.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open (unused)  KEYS[4]  <prefix>:{P}:dup (unused)
-- KEYS[5]  <prefix>:{P}:held (unused)
-- KEYS[6]  <prefix>:uncertain:{T}:t:<tenant> (unused)
-- KEYS[7]  <prefix>:uncertain:{T} (unused)
-- KEYS[8]  <prefix>:{P}:pending
-- KEYS[9]  <prefix>:{P}:awaiting (unused)
-- KEYS[10] <prefix>:approvals:{T}:t:<tenant> (unused)
--          (the store passes the ten keys of the scripts that move
--          attempts: lib.lua)
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  the caller's tenant     ARGV[3]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", hash}, hash the permit as HGETALL gives it (reserved and
-- n:<tool> less what lapsed calls hold), or
-- {"ERR", "PERMIT_NOT_FOUND"} (none, or forgotten: lib.lua, forgotten) |
-- {"ERR", "STORE_UNAVAILABLE", why} (the record, read whole, not as atmost
-- writes it: lib.lua, readable_record; a pending member that names no
-- pending call, or a record or counter that cannot be read; or the permit
-- gone while its attempts remain).
-- Example: ARGV={""} -> {"OK", {"subject","agent-7","currency","EUR",...}}

local now = clock(ARGV[1])
local p, refused = permit_for(KEYS, now, ARGV[2], ARGV[3], 'appr')
if refused then
  return refused
end
local hash = redis.call('HGETALL', KEYS[1])
if not readable_record(hash) then
  return UNREADABLE_PERMIT
end
local calls, unreadable = pending_read(KEYS, p, '(' .. at15(now + 1), true)
if not calls then
  return unreadable
end
if #calls > 0 then
  for i = 1, #hash, 2 do
    local name = hash[i]
    if name == 'reserved' then
      hash[i + 1] = int(calls.reserved)
    elseif string.sub(name, 1, 2) == 'n:' and calls.n[string.sub(name, 3)] then
      hash[i + 1] = int(calls.n[string.sub(name, 3)])
    end
  end
end
return {'OK', hash}
