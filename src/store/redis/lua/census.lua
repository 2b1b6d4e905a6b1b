#!lua flags=no-writes
-- census.lua: how many of one permit's attempts are UNCERTAIN at `now`
-- (including RESERVED ones past their lease), and since when the oldest
-- has been, for the uncertain census (src/telemetry/census.rs). Two range
-- reads of the open set: O(log n) however many attempts are open.
--
-- KEYS[1]  <prefix>:{P}:permit     KEYS[2]  <prefix>:{P}:open
-- ARGV[1]  now (ms; "" = Redis's clock)
--
-- Returns {"OK", now, uncertain, oldest_since} (oldest_since 0 when none
-- is uncertain). A permit that is gone, or has nothing open, counts 0. A
-- permit whose exp or open counter is missing or not as atmost writes it,
-- or whose first uncertain member is not "<at>:<key>", answers
-- {"ERR", "STORE_UNAVAILABLE", why}: never counted as 0 (the pass fails,
-- and its census age tells).
-- Example: ARGV={""} -> {"OK", "1767225600000", 2, "1767225590000"}

local now = clock(ARGV[1])
local p = read_permit(KEYS[1], 'exp', 'open')
if not p then
  return {'OK', int(now), 0, '0'}
elseif p.unreadable then
  return UNREADABLE_PERMIT
end
if p.open == 0 then
  return {'OK', int(now), 0, '0'}
end
-- Members up to "<now + 1>" (exclusive) are those uncertain at `now`.
local upto = '(' .. at15(now + 1)
local n = redis.call('ZLEXCOUNT', KEYS[2], '-', upto)
if n == 0 then
  return {'OK', int(now), 0, '0'}
end
local first = redis.call('ZRANGEBYLEX', KEYS[2], '-', upto, 'LIMIT', 0, 1)[1]
if not string.find(first, '^' .. string.rep('[0-9]', 15) .. ':.') then
  return OPEN_SET_DISAGREES
end
return {'OK', int(now), n, string.sub(first, 1, 15)}
