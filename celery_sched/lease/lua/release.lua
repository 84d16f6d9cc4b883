-- Drop the leader lease only where the caller's token still holds it, so a
-- leader whose lease already expired cannot delete its successor's lease.
-- Each given key is compared and deleted on its own: a key the caller still
-- holds is dropped even when another one has lapsed.
--
-- KEYS     the lease keys (the hash-tagged one first)
-- ARGV[1]  the caller's token
-- Returns 1 when the caller's token held (and lost) any key, else 0.
local dropped = 0
for _, key in ipairs(KEYS) do
    if redis.call('GET', key) == ARGV[1] then
        redis.call('DEL', key)
        dropped = 1
    end
end
return dropped
