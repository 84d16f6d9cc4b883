-- The live beats of a fleet, in one sorted set (member: beat id, score: the
-- instant its listing runs out, in ms of this server's clock).
-- KEYS[1] the set; ARGV[1] a beat id to list ('' to only read);
-- ARGV[2] how long it stays listed, in ms.
-- Returns every listed beat id, sorted, after dropping the expired ones.
local now = redis.call('TIME')
local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
if ARGV[1] ~= '' then
  redis.call('ZADD', KEYS[1], ms + ttl, ARGV[1])
end
-- The set outlives its last member by a little, then goes by itself.
redis.call('PEXPIRE', KEYS[1], ttl * 3)
return redis.call('ZRANGE', KEYS[1], 0, -1)
