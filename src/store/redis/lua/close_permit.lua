#!lua
-- close_permit.lua: before a permit leaves the cross-permit index, close it
-- for new keys, so none can open an attempt under it afterwards whatever
-- Redis's clock does (a step back, a failover to a node whose clock is
-- behind): the index must keep every permit that may hold an open attempt.
--
-- Closing it also drops its entries from the approvals index (lib.lua):
-- every request it had lapsed by its expiry, written or not, so none is
-- listed, and none would be left behind once its keys expire.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:attempts
-- KEYS[3]  <prefix>:{P}:awaiting
-- KEYS[4]  <prefix>:approvals:{T}:t:<tenant>  (the approvals index's shard)
-- ARGV[1]  now (ms; "" = Redis's clock)
-- ARGV[2]  index margin (ms)
--
-- Returns {"OK", 1} when the permit is closed (it expired more than the
-- margin ago and has no open attempt, now or at an earlier close), so it
-- may leave the index; {"OK", 0} when it may not; or
-- {"ERR", "PERMIT_NOT_FOUND"} (gone: it may leave the index) |
-- {"ERR", "STORE_UNAVAILABLE", why} (a field not as atmost writes it, an
-- awaiting member not "<created>:<key>", a key of another type: nothing
-- is written; or the permit gone while its attempts remain).
-- Example: ARGV={"", 60000} -> {"OK", 1}

local now = clock(ARGV[1])
local p = read_permit(KEYS[1], 'exp', 'open', 'fa', 'closed', 'appr')
if not p then
  return permit_not_found(KEYS[2])
elseif p.unreadable then
  return UNREADABLE_PERMIT
elseif forgotten(p, now) then
  return PERMIT_NOT_FOUND
end
if p.closed then
  return {'OK', 1}
end
if p.open == 0 and now > p.exp + tonumber(ARGV[2]) then
  local entries = {}
  if p.appr then
    for _, member in ipairs(redis.call('ZRANGEBYLEX', KEYS[3], '-', '+')) do
      local at, key = string.match(member, '^(' .. string.rep('%d', 15) .. '):(.+)$')
      if not at then
        return AWAITING_SET_DISAGREES
      end
      entries[#entries + 1] = index_member(KEYS, tonumber(at), key)
    end
    if #entries > 0 and type(redis.pcall('ZCARD', KEYS[4])) ~= 'number' then
      return APPROVALS_OF_ANOTHER_TYPE
    end
  end
  redis.call('HSET', KEYS[1], 'closed', '1')
  for _, entry in ipairs(entries) do
    redis.call('ZREM', KEYS[4], entry)
  end
  return {'OK', 1}
end
return {'OK', 0}
