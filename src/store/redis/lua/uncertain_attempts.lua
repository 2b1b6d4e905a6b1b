#!lua flags=no-writes
-- uncertain_attempts.lua: the attempts of one permit that the uncertain
-- index named (list_index.lua), those still UNCERTAIN at `now`: an
-- attempt settled since is left out, one still open is read whole.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open
-- KEYS[4]  <prefix>:uncertain:{T}:t:<tenant>  (the permit's shard of the
--          caller's tenant's index: lib.lua)
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  the caller's tenant     ARGV[3]  the caller's agent key id (""
--          = not limited): lib.lua, visible
-- ARGV[4..] open-set members ("<at>:<key>"), in order
--
-- Returns {"OK", attempt, attempt, ...}, or {"ERR", "PERMIT_NOT_FOUND"}
-- (not the caller's to see; or gone, with none of the members in the
-- index any more: settled and forgotten since they were listed), or
-- {"ERR", "STORE_UNAVAILABLE", why} when the index still names an attempt
-- of a permit that is gone or one missing from the open set, a member
-- still in the open set is not an uncertain attempt's place, or its record
-- cannot be read: an open attempt is never skipped. A member uncertain
-- only after `now` (listed on a clock that has since stepped back) is
-- left out: not uncertain on this reading.
-- Example: ARGV={"","acme","","001767225590000:order-42"} -> {"OK", {<attempt>}}

local now = clock(ARGV[1])
local _, refused = permit_for(KEYS, now, ARGV[2], ARGV[3])
if refused then
  if redis.call('EXISTS', KEYS[1]) == 0 then
    for i = 4, #ARGV do
      local at, key = string.match(ARGV[i], '^(%d+):(.+)$')
      if at and redis.call('ZSCORE', KEYS[4], index_member(KEYS, tonumber(at), key)) then
        return {'ERR', 'STORE_UNAVAILABLE', 'the uncertain index names an attempt of a permit that is gone'}
      end
    end
  end
  return refused
end
local out = {'OK'}
for i = 4, #ARGV do
  local member = ARGV[i]
  local at, key = string.match(member, '^(%d+):(.+)$')
  if not at then
    return OPEN_SET_DISAGREES
  end
  at = tonumber(at)
  if redis.call('ZSCORE', KEYS[3], member) then
    -- Listed on another reading of the clock: past `now` (the clock
    -- stepped back), it is not uncertain yet on this one.
    if at <= now then
      local a = uncertain_member(KEYS[2], member, nil, now)
      if not a then
        return OPEN_SET_DISAGREES
      end
      out[#out + 1] = attempt_reply(a, key, now)
    end
  elseif redis.call('ZSCORE', KEYS[4], index_member(KEYS, at, key)) then
    -- Settled since it was listed: gone from both. Still in the index
    -- but not in the open set: the records disagree.
    return OPEN_SET_DISAGREES
  end
end
return out
