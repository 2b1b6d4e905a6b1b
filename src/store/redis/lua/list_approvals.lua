#!lua flags=no-writes
-- list_approvals.lua: one permit's calls AWAITING_APPROVAL at `now`, in
-- (created, key) order after a cursor (domain/ledger.rs:
-- Ledger::awaiting_after): one range read of the awaiting set, skipping
-- the requests that lapsed (their lapse not yet written). Reads only.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:awaiting
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  list after this awaiting-set member ("<created>:<key>"; "" =
--          from the start)
-- ARGV[3]  read at most this many members (at least 1)
-- ARGV[4]  the caller's tenant     ARGV[5]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", read, last, attempt, attempt, ...}: how many members were
-- read, and the last ("" when none was), for the next run to go on after;
-- or
-- {"ERR", "PERMIT_NOT_FOUND"} | {"ERR", "STORE_UNAVAILABLE", why} when a
-- record cannot be read (a permit field not as atmost writes it; a member
-- that does not name a call awaiting approval since its creation, or
-- whose record cannot be read): a waiting call is never skipped.
-- Example: ARGV={"","",100,"acme",""}
--   -> {"OK", 1, "001767225590000:order-42", {<attempt>}}

local now = clock(ARGV[1])
local _, refused = permit_for(KEYS, now, ARGV[4], ARGV[5])
if refused then
  return refused
end
local from = '-'
if ARGV[2] ~= '' then
  from = '(' .. ARGV[2]
end
local members = redis.call('ZRANGEBYLEX', KEYS[3], from, '+', 'LIMIT', 0,
  tonumber(ARGV[3]))
local out = {'OK', #members, members[#members] or ''}
for _, member in ipairs(members) do
  local key = string.sub(member, 17)
  local a = key ~= '' and load_attempt(KEYS[2], key)
  if not a or a.state ~= AWAITING or member ~= at15(a.created) .. ':' .. key then
    return AWAITING_SET_DISAGREES
  end
  if observed_state(a, now) == AWAITING then
    out[#out + 1] = attempt_reply(a, key, now)
  end
end
return out
