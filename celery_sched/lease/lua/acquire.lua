-- Take the leader lease on every given key, or on none of them.
-- During a rolling upgrade a new beat holds the legacy key (the only one old
-- beats know) as well as the hash-tagged one; doing both SETs here, after
-- checking both are free, means no old or new beat can slip in between.
-- On a Redis Cluster only the hash-tagged key is given (one slot).
--
-- KEYS     the lease keys (the hash-tagged one first)
-- ARGV[1]  the caller's token
-- ARGV[2]  the time-to-live in milliseconds
-- Returns 1 when the lease was taken, 0 when any key is already held.
for _, key in ipairs(KEYS) do
    if redis.call('EXISTS', key) == 1 then
        return 0
    end
end
for _, key in ipairs(KEYS) do
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
end
return 1
