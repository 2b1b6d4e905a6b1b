#!lua
-- census_turn.lua: one census per fleet per interval. The fleet's last
-- figures, if fresh; else the turn to count them, to the first replica
-- that asks while no other holds it (the others read the last figures,
-- however old, meanwhile).
--
-- KEYS[1]  <prefix>:census:{c}  HASH  the fleet's last figures: uncertain,
--          oldest (age in ms when counted), at (when counted; absent until
--          a first count), and the turn: until (ms), by (a replica's token)
-- ARGV[1]  now (ms; "" = Redis's clock)  ARGV[2]  interval (ms, >= 1)
-- ARGV[3]  this replica's token (census_publish.lua)
--
-- Returns {"COUNT", now}: count now (the turn is this replica's for one
-- interval); or {"FIGURES", now, uncertain, oldest, at}: the last figures
-- (at = 0 when none were published yet), fresh, or older while another
-- replica holds the turn; or {"ERR", "STORE_UNAVAILABLE",
-- why} for a hash not as atmost writes it (nothing is written then).
-- Example: ARGV={"","10000","<uuid>"} -> {"COUNT", "1767225600000"}

local now, interval = clock(ARGV[1]), tonumber(ARGV[2])
local f = redis.call('HMGET', KEYS[1], 'uncertain', 'oldest', 'at', 'until')
local uncertain, oldest, at, turn = uint(f[1]), uint(f[2]), uint(f[3]), uint(f[4])
if (f[1] or f[2] or f[3]) and not (uncertain and oldest and at) or (f[4] and not turn) then
  return {'ERR', 'STORE_UNAVAILABLE', 'census figures not as atmost writes them'}
end
local figures = {'FIGURES', int(now), int(uncertain or 0), int(oldest or 0), int(at or 0)}
-- Fresh: counted within the interval. Figures (or a turn) from after `now`
-- are not: the clock stepped back, and they would read as new until it
-- caught up.
if (at and at <= now and now - at < interval)
    or (turn and now < turn and turn <= now + interval) then
  return figures
end
redis.call('HSET', KEYS[1], 'until', int(now + interval), 'by', ARGV[3])
redis.call('PEXPIREAT', KEYS[1], int(now + 10 * interval))
return {'COUNT', int(now)}
