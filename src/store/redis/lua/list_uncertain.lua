-- list_uncertain.lua: one permit's attempts that are UNCERTAIN at `now`
-- (including RESERVED ones past their lease), in key order after a cursor.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:open
-- ARGV[1]  now (ms)                ARGV[2]  list keys after this one ("" = from the start)
-- ARGV[3]  at most this many       ARGV[4]  index margin (ms)
--
-- Returns {"OK", removable, attempt, attempt, ...}, or
-- {"ERR", "PERMIT_NOT_FOUND"} (a permit that is gone may leave the
-- cross-permit index), or {"ERR", "STORE_UNAVAILABLE", why} when a record
-- cannot be read (no open counter; an open key without an attempt, or with
-- a state this version does not know): an open attempt is never skipped.
-- removable is 1 when the permit may leave the index: expired more than the
-- margin ago with no open attempt, so no new key can open one any more.
-- Example: ARGV={"1767225600000","",100,3600000} -> {"OK", 0, {<attempt>}, ...}

local now, limit = tonumber(ARGV[1]), tonumber(ARGV[3])
local p = redis.call('HMGET', KEYS[1], 'exp', 'open')
if not p[1] then
  return {'ERR', 'PERMIT_NOT_FOUND'}
end
if not p[2] then
  return {'ERR', 'STORE_UNAVAILABLE', 'unreadable permit record'}
end
local removable = 0
if tonumber(p[2]) == 0 and now > tonumber(p[1]) + tonumber(ARGV[4]) then
  removable = 1
end
local out = {'OK', removable}
local from = '-'
if ARGV[2] ~= '' then
  from = '(' .. ARGV[2]
end
while #out - 2 < limit do
  local keys = redis.call('ZRANGEBYLEX', KEYS[3], from, '+', 'LIMIT', 0, 128)
  if #keys == 0 then
    break
  end
  for _, key in ipairs(keys) do
    local a = load_attempt(KEYS[2], key)
    if not a or not known_state(a.state) then
      return {'ERR', 'STORE_UNAVAILABLE', 'unreadable attempt record'}
    end
    if observed_state(a, now) == UNCERTAIN then
      out[#out + 1] = attempt_reply(a, key, now)
      if #out - 2 == limit then
        break
      end
    end
  end
  from = '(' .. keys[#keys]
end
return out
