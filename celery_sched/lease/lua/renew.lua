-- Extend the leader lease only while the caller's token still holds it.
-- One script so that no other client can take the key between the compare
-- and the PEXPIRE (a GET followed by PEXPIRE could extend a rival's lease).
--
-- KEYS[1]  the lease key
-- ARGV[1]  the caller's token
-- ARGV[2]  the new time-to-live in milliseconds
-- Returns 1 when the lease was extended, 0 when the token no longer holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
