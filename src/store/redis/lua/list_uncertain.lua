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
-- ARGV[4]  index margin (ms)
-- ARGV[5]  the caller's tenant     ARGV[6]  the caller's agent key id (""
--          = not limited): lib.lua, visible
--
-- Returns {"OK", expires_at, removable, attempt, attempt, ...}, or
-- {"ERR", "PERMIT_NOT_FOUND"} (a permit that is gone may leave the
-- cross-permit index), or {"ERR", "STORE_UNAVAILABLE", why} when a record
-- cannot be read (no open counter; an open-set member without its attempt,
-- or whose attempt is not uncertain): an open attempt is never skipped.
-- removable is 1 when the permit may leave the index: expired more than
-- the margin ago with no open attempt (close_permit.lua then closes it, so
-- no new key can open one any more).
-- Example: ARGV={"","",100,60000} -> {"OK", "1767225600000", 0, {<attempt>}, ...}

local now, limit = clock(ARGV[1]), tonumber(ARGV[3])
local p = redis.call('HMGET', KEYS[1], 'exp', 'open', 'fa', 'ten', 'agents')
if not p[1] or forgotten(p[3], p[2], now) then
  return permit_not_found(p[1], KEYS[2])
end
if not visible(p[4], p[5], ARGV[5], ARGV[6]) then
  return NOT_VISIBLE
end
local exp, open = tonumber(p[1]), tonumber(p[2])
if not (exp and open) then
  return UNREADABLE_PERMIT
end
local removable = 0
if open == 0 and now > exp + tonumber(ARGV[4]) then
  removable = 1
end
local out = {'OK', p[1], removable}
local from = '-'
if ARGV[2] ~= '' then
  from = '(' .. ARGV[2]
end
-- Members up to "<now + 1>" (exclusive) are those uncertain at `now`.
local members = redis.call('ZRANGEBYLEX', KEYS[3], from, '(' .. at15(now + 1),
  'LIMIT', 0, limit)
for _, member in ipairs(members) do
  local key = string.sub(member, 17)
  local a = load_attempt(KEYS[2], key)
  -- A member is an open attempt uncertain at `now`, or the records
  -- disagree: never skipped, never guessed.
  if not a or observed_state(a, now) ~= UNCERTAIN then
    return {'ERR', 'STORE_UNAVAILABLE', 'unreadable attempt record'}
  end
  out[#out + 1] = attempt_reply(a, key, now)
end
return out
