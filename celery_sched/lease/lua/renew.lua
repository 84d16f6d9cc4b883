-- Extend the leader lease only while the caller's token still holds it, on
-- every given key. One script so that no other client can take a key
-- between the compare and the PEXPIRE (a GET followed by PEXPIRE could
-- extend a rival's lease). If any key no longer holds the token (the legacy
-- key expired or was taken during an upgrade), nothing is extended and the
-- caller steps down: holding only one key would let an old or a new beat in.
--
-- KEYS     the lease keys (the hash-tagged one first)
-- ARGV[1]  the caller's token
-- ARGV[2]  the new time-to-live in milliseconds
-- Returns 1 when the lease was extended, 0 when the token no longer holds it.
for _, key in ipairs(KEYS) do
    if redis.call('GET', key) ~= ARGV[1] then
        return 0
    end
end
for _, key in ipairs(KEYS) do
    redis.call('PEXPIRE', key, ARGV[2])
end
return 1
