#!lua flags=no-writes
-- list_uncertain.lua: one permit's attempts that are UNCERTAIN at `now`
-- (including RESERVED ones past their lease), in (uncertain since, key)
-- order after a cursor: one range read of the open set, so a page costs
-- O(log n + page) however many attempts are open.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  list after this open-set member ("<at>:<key>"; "" = from the start)
-- ARGV[3]  at most this many (at least 1)
-- ARGV[4]  the caller's tenant     ARGV[5]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", attempt, attempt, ...}, or {"ERR", "PERMIT_NOT_FOUND"},
-- or {"ERR", "STORE_UNAVAILABLE", why} when a record cannot be read (a
-- permit field not as atmost writes it; an open-set member that is not an
-- uncertain attempt's place, or whose attempt record cannot be read): an
-- open attempt is never skipped.
-- Example: ARGV={"","",100,"acme",""} -> {"OK", {<attempt>}, ...}

local now, limit = clock(ARGV[1]), tonumber(ARGV[3])
local _, refused = permit_for(KEYS, now, ARGV[4], ARGV[5])
if refused then
  return refused
end
local out = {'OK'}
local from = '-'
if ARGV[2] ~= '' then
  from = '(' .. ARGV[2]
end
-- Members up to "<now + 1>" (exclusive) are those uncertain at `now`.
local members = redis.call('ZRANGEBYLEX', KEYS[3], from, '(' .. at15(now + 1),
  'LIMIT', 0, limit)
for _, member in ipairs(members) do
  -- A member is an open attempt uncertain at `now`, in its place, or the
  -- records disagree: never skipped, never guessed.
  local a, key = uncertain_member(KEYS[2], member, nil, now)
  if not a then
    return OPEN_SET_DISAGREES
  end
  out[#out + 1] = attempt_reply(a, key, now)
end
return out
