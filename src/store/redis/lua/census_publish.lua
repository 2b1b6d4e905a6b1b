#!lua
-- census_publish.lua: the figures this replica counted in its turn
-- (census_turn.lua), for the fleet; kept for ten intervals.
--
-- KEYS[1]  <prefix>:census:{c}
-- ARGV[1]  uncertain               ARGV[2]  oldest (age in ms when counted)
-- ARGV[3]  when counted (ms, the store's clock)
-- ARGV[4]  interval (ms)           ARGV[5]  this replica's token
--
-- Returns {"OK"}: the figures replace whatever is there (two replicas
-- count at once only when a count outlasts its turn: either is recent).
-- The turn ends if it was this replica's.
-- Example: ARGV={"2","5000","1767225600000","10000","<uuid>"} -> {"OK"}

local by = redis.call('HGET', KEYS[1], 'by')
redis.call('HSET', KEYS[1], 'uncertain', ARGV[1], 'oldest', ARGV[2], 'at', ARGV[3])
if by == ARGV[5] then
  redis.call('HDEL', KEYS[1], 'until', 'by')
end
redis.call('PEXPIREAT', KEYS[1], int(tonumber(ARGV[3]) + 10 * tonumber(ARGV[4])))
return {'OK'}
