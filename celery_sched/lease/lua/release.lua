-- Drop the leader lease only when the caller's token still holds it, so a
-- leader whose lease already expired cannot delete its successor's lease.
--
-- KEYS[1]  the lease key
-- ARGV[1]  the caller's token
-- Returns 1 when the lease was dropped, 0 when the token did not hold it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
