-- push.lua: push one frame below the hwm (the capped push).
-- Returns {'OK', depth} or {'FULL', depth}, {'GONE'} (the referenced frame expired:
-- store it again), {'LEASE_LOST'}, {'REAPED'}, {'STATE_LOST'}, {'RUN_CHANGED'},
-- {'FINISHED'}, {'WRONG_TYPE', key, type} (a foreign writer replaced the data list: wait),
-- {'REROUTE'} (a shared-memory descriptor for a host the rank's trainer has not
-- published: send the frame itself)
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local data_key = KEYS[3]         -- LIST   the data list (a rank's, data-parallel)
local stats_key = KEYS[4]        -- HASH   queue counters
local producers_key = KEYS[5]    -- ZSET   producer -> heartbeat deadline (ms)
local lease_key = KEYS[6]        -- LIST   this producer's leases
local pstats_key = KEYS[7]       -- HASH   per-producer counters
local frame_key = KEYS[8]        -- STRING only for a frame stored by reference
local incarnation = ARGV[1]
local run = ARGV[2]
local producer = ARGV[3]
local entry = ARGV[4]            -- lease entry '<g>:<run>:<token>' the frame belongs to
local element = ARGV[5]          -- the frame itself, or a reference to frame_key
local last = ARGV[6]             -- '1' if the shard's last frame (the lease is released)
local heartbeat_ttl_ms = tonumber(ARGV[7])
local frame_bytes = tonumber(ARGV[8])
local blocked_ms = tonumber(ARGV[9])  -- spent blocked at the hwm since the last try
local produce_ms = tonumber(ARGV[10]) -- the pipeline took to build this batch
local shm_host = ARGV[11]        -- the host a descriptor's segment is on; '' for a frame
local host_field = ARGV[12]      -- the meta field of the rank's published host

local now = server_now_ms()
-- Every key's type first: a foreign type found half-way would leave a frame pushed and
-- its lease held (a script's writes are not rolled back). The types are
-- batchq.protocol.keys.KEY_TYPES; the per-producer counters below (field
-- '<producer>:<counter>') are batchq.protocol.fields.ProducerStat.
local typed = {
  {meta_key, 'hash'}, {incarnation_key, 'string'}, {data_key, 'list'}, {stats_key, 'hash'},
  {producers_key, 'zset'}, {lease_key, 'list'}, {pstats_key, 'hash'},
}
local refused = wrong_type(typed)
if refused then return refused end
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local m = redis.call('HMGET', meta_key, 'run', 'finished', 'hwm', host_field)
refused = run_refused(m, run) or heartbeat(producers_key, producer, now + heartbeat_ttl_ms)
if refused then return refused end
if not redis.call('LPOS', lease_key, entry) then return {'LEASE_LOST'} end
count_blocked(stats_key, pstats_key, producer, blocked_ms)
-- A descriptor goes only into the list of a trainer on its host: one whose trainer
-- changed (a takeover, another rank's host) would get a segment it cannot map.
if shm_host ~= '' and m[4] ~= shm_host then return {'REROUTE'} end
-- The stored frame expired, or a foreign writer put another type there: store it again.
if frame_key and redis.call('TYPE', frame_key).ok ~= 'string' then return {'GONE'} end

local depth = redis.call('LLEN', data_key)
if depth >= tonumber(m[3]) then return {'FULL', depth} end
redis.call('LPUSH', data_key, element)
if frame_key then redis.call('PERSIST', frame_key) end
count_push(stats_key, pstats_key, producer, frame_bytes, produce_ms)
if last == '1' then shard_pushed(stats_key, lease_key, entry) end
return {'OK', depth + 1}
