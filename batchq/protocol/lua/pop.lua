-- pop.lua: the trainer pops up to N frames; pops first, then wakes producers.
-- Returns {'OK', producers alive, depth before the pop, {elements...}, group slots},
--   {'STATE_LOST'}, {'RUN_CHANGED'}, {'CLAIM_LOST'} or {'WRONG_TYPE', key, type}
-- At maxmemory Redis refuses a script whose first write may grow memory, so the pop
-- comes first and the bookkeeping after it, through pcall.
local meta_key = KEYS[1]         -- HASH   the run's meta
local incarnation_key = KEYS[2]  -- STRING
local data_key = KEYS[3]         -- LIST   the data list (this rank's, data-parallel)
local wake_key = KEYS[4]         -- LIST   producers blocked at the hwm wait on it
local stats_key = KEYS[5]        -- HASH   queue counters
local producers_key = KEYS[6]    -- ZSET   producer -> heartbeat deadline (ms)
local trainer_key = KEYS[7]      -- HASH   the trainer's (rank's) recent figures
local history_key = KEYS[8]      -- LIST   the trainer's (rank's) history samples
local pstats_key = KEYS[9]       -- HASH   read only: the producers' build totals
local incarnation = ARGV[1]
local run = ARGV[2]
local token = ARGV[3]            -- the trainer's claim token
local room = tonumber(ARGV[4])   -- max frames to pop (0: only account, e.g. at close)
local floor = tonumber(ARGV[5])  -- the trainer's floor (oldest incomplete shard)
local claim_ttl_ms = tonumber(ARGV[6])
local extra_popped = tonumber(ARGV[7])  -- frames popped outside this script (BRPOP)
local nbytes = tonumber(ARGV[8])        -- bytes received since the last call
local waited_ms = tonumber(ARGV[9])     -- spent waiting for data
local busy_ms = tonumber(ARGV[10])      -- the trainer's own work between batches
local epochs = tonumber(ARGV[11])       -- epochs completed since the last call
local buckets = ARGV[12]         -- wait-time histogram increments 'c1,c2,...' or ''
local figures = ARGV[13]         -- the trainer's figures, JSON object, or ''
local sample = ARGV[14]          -- a history sample, JSON object, or '' (batchq.monitoring.sizing)
local sfx = ARGV[15]              -- meta field suffix: '' (world 1) or ':<rank>'
local wake_cap = tonumber(ARGV[16])     -- the wake list's length cap
local history_cap = tonumber(ARGV[17])  -- history samples kept

local now = server_now_ms()
local refused = wrong_type({{meta_key, 'hash'}, {incarnation_key, 'string'}, {data_key, 'list'}})
if refused then
  -- Keep the claim while the trainer waits for the list to be repaired.
  if refused[2] == data_key then
    redis.pcall('HSET', meta_key, 'claim_deadline' .. sfx, now + claim_ttl_ms)
  end
  return refused
end
if redis.call('GET', incarnation_key) ~= incarnation then return {'STATE_LOST'} end
local m = redis.call('HMGET', meta_key, 'run', 'claim' .. sfx, 'hwm', 'floor' .. sfx, 'groups')
if m[1] ~= run then return {'RUN_CHANGED'} end
if m[2] ~= token then return {'CLAIM_LOST'} end

local depth = redis.call('LLEN', data_key)
local items = {}
if depth > 0 and room > 0 then items = redis.call('RPOP', data_key, math.min(room, depth)) end
-- Bookkeeping through pcall: with nothing popped a full server cannot make an empty poll
-- fail, and with frames popped a foreign type under a bookkeeping key (wake, stats)
-- cannot lose them.
local call = redis.pcall

-- Producers refused at the hwm wait for a wake: one per frame taken from a full list,
-- counting those BRPOP took since the last call (the list held them too).
local popped = #items + extra_popped
local wake = 0
if popped > 0 and m[3] and depth + extra_popped >= tonumber(m[3]) then wake = popped end
if m[4] and floor > tonumber(m[4]) then
  call('HSET', meta_key, 'floor' .. sfx, floor)
  wake = wake + 1
end
if wake > 0 then
  for _ = 1, math.min(wake, wake_cap) do call('LPUSH', wake_key, '1') end
  call('LTRIM', wake_key, 0, wake_cap - 1)
end
call('HSET', meta_key, 'claim_deadline' .. sfx, now + claim_ttl_ms)
if popped > 0 then call('HINCRBY', stats_key, 'popped', popped) end
if nbytes > 0 then call('HINCRBY', stats_key, 'popped_bytes', nbytes) end
if waited_ms > 0 then call('HINCRBY', stats_key, 'trainer_wait_ms', waited_ms) end
if busy_ms > 0 then call('HINCRBY', stats_key, 'trainer_busy_ms', busy_ms) end
if epochs > 0 then call('HINCRBY', stats_key, 'epochs_completed', epochs) end
if buckets ~= '' then
  local i = 0
  for c in string.gmatch(buckets, '[^,]+') do
    if c ~= '0' then call('HINCRBY', stats_key, 'wait_bucket:' .. i, tonumber(c)) end
    i = i + 1
  end
end
if figures ~= '' then
  for field, value in pairs(cjson.decode(figures)) do
    call('HSET', trainer_key, field, tostring(value))
  end
  call('HSET', trainer_key, 'updated_ms', now)
end
-- The queue side of the history sample: batchq.protocol.fields.HistoryField.QUEUE_SIDE,
-- summed from the live producers' counters (batchq.protocol.fields.ProducerStat).
if sample ~= '' then
  local ok, s = pcall(cjson.decode, sample)
  if ok and type(s) == 'table' then
    local live = redis.call('ZRANGEBYSCORE', producers_key, now, '+inf')
    local built, build_ms = 0, 0
    for _, p in ipairs(live) do
      local v = redis.call('HMGET', pstats_key, p .. ':batches', p .. ':produce_ms')
      built, build_ms = built + (tonumber(v[1]) or 0), build_ms + (tonumber(v[2]) or 0)
    end
    s['producers'] = #live
    s['pushed'] = tonumber(redis.call('HGET', stats_key, 'pushed')) or 0
    s['built'] = built
    s['build_ms'] = build_ms
    sample = cjson.encode(s)
  end
  call('LPUSH', history_key, sample)
  call('LTRIM', history_key, 0, history_cap - 1)
end
local alive = redis.pcall('ZCOUNT', producers_key, now, '+inf')
if type(alive) ~= 'number' then alive = 0 end  -- a foreign type: the frames still go out
-- groups: the run's group slots (0: one group), so that a trainer of a run that other
-- groups joined since it claimed releases what it reads (frames stored once for all).
return {'OK', alive, depth, items, tonumber(m[5] or '0')}
