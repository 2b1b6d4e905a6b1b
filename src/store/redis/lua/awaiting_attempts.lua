#!lua flags=no-writes
-- awaiting_attempts.lua: the calls of one permit that the approvals index
-- named (list_index.lua), those still AWAITING_APPROVAL at `now`: one
-- approved, denied or lapsed since is left out.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  the caller's tenant     ARGV[3]  the caller's agent key id (""
--          = not limited): lib.lua, visible
-- ARGV[4..] awaiting-set members ("<created>:<key>"), in order
--
-- Returns {"OK", attempt, attempt, ...}, or {"ERR", "PERMIT_NOT_FOUND"}
-- (not the caller's to see, or gone: every request it had lapsed with it),
-- or {"ERR", "STORE_UNAVAILABLE", why} when a record cannot be read (a
-- permit field not as atmost writes it, an attempt record of another
-- shape).
-- Example: ARGV={"","acme","","001767225590000:order-42"} -> {"OK", {<attempt>}}

local now = clock(ARGV[1])
local _, refused = permit_for(KEYS, now, ARGV[2], ARGV[3])
if refused then
  return refused
end
local out = {'OK'}
for i = 4, #ARGV do
  local at, key = string.match(ARGV[i], '^(%d+):(.+)$')
  local a = key and load_attempt(KEYS[2], key)
  if a == false then
    return UNREADABLE_ATTEMPT
  end
  -- Still the call the index named (created then), and still waiting.
  if a and a.created == tonumber(at) and observed_state(a, now) == AWAITING then
    out[#out + 1] = attempt_reply(a, key, now)
  end
end
return out
