-- Pop up to ARGV[2] members of the ZSET KEYS[1] scored at or before ARGV[1].
--
-- KEYS[1]  the shard's staging ZSET (member = job id hex, score = due epoch seconds)
-- ARGV[1]  the inclusive maximum score ("now" in epoch seconds)
-- ARGV[2]  the most members to pop (a positive integer)
-- ARGV[3]  optional: members scored at or before it are discarded first, not returned
--
-- Returns the popped members, earliest score first (ties by member).
--
-- Reading and removing in one script is what makes the pop atomic: no other
-- client can run between the two calls, so two poppers never get the same id.
if ARGV[3] then
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
end
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
local n = #ids
if n > 0 then
    -- The range above starts at offset 0 of the score order, so the popped ids
    -- are exactly ranks 0 .. n-1. Removing by rank deletes exactly those
    -- members without spreading them over ZREM's argument list, which Lua's
    -- unpack() would cap at a few thousand.
    redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1)
end
return ids
