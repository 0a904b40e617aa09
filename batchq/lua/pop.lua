-- pop.lua: the trainer pops up to N frames; pops first, then wakes producers.
-- KEYS[1] meta  KEYS[2] incarnation  KEYS[3] data  KEYS[4] wake  KEYS[5] stats
-- KEYS[6] producers  KEYS[7] trainer (HASH of recent figures)  KEYS[8] history
-- KEYS[9] pstats (read only: the live producers' build totals for the history sample)
-- ARGV[1] incarnation  ARGV[2] run  ARGV[3] claim token
-- ARGV[4] max frames to pop (0: only account, e.g. the trainer's last figures at close)
-- ARGV[5] the trainer's floor (oldest incomplete global shard)
-- ARGV[6] claim ttl (ms)
-- ARGV[7] frames popped outside this script since the last call (BRPOP)
-- ARGV[8] bytes received since the last call  ARGV[9] ms spent waiting for data
-- ARGV[10] ms the trainer spent between batches (its own work) since the last call
-- ARGV[11] epochs completed since the last call
-- ARGV[12] wait-time histogram increments, 'c1,c2,...' per bucket ('' for none)
-- ARGV[13] the trainer's figures as a JSON object ('' for none): stored in KEYS[7]
-- ARGV[14] a history sample as a JSON object ('' for none): pushed on KEYS[8] (capped),
--          with the queue side of the moment added (see batchq.sizing): 'producers'
--          alive, 'pushed' frames, and the live producers' 'built' batches and 'build_ms'
-- ARGV[15] the rank's meta field suffix: '' (world 1) or ':<rank>' (batchq/ranks.py);
--          KEYS[3], KEYS[7] and KEYS[8] are then that rank's data list, figures and
--          history
-- Returns {'OK', producers alive, depth before the pop, {elements...}}
--      or {'STATE_LOST'}, {'RUN_CHANGED'}, {'CLAIM_LOST'},
--         {'WRONG_TYPE', key, type} (a foreign writer put another type under a queue key)
-- At maxmemory Redis refuses a script whose first write may grow memory, so the pop
-- comes first and the bookkeeping after it, through pcall.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i, want in ipairs({'hash', 'string', 'list'}) do
  local kind = redis.call('TYPE', KEYS[i]).ok
  if kind ~= want and kind ~= 'none' then
    if i == 3 then
      -- Keep the claim while the trainer waits for the list to be repaired.
      redis.pcall('HSET', KEYS[1], 'claim_deadline' .. (ARGV[15] or ''),
        now + tonumber(ARGV[6]))
    end
    return {'WRONG_TYPE', KEYS[i], kind}
  end
end
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return {'STATE_LOST'} end
local sfx = ARGV[15] or ''
local m = redis.call('HMGET', KEYS[1], 'run', 'claim' .. sfx, 'hwm', 'floor' .. sfx)
if m[1] ~= ARGV[2] then return {'RUN_CHANGED'} end
if m[2] ~= ARGV[3] then return {'CLAIM_LOST'} end

local depth = redis.call('LLEN', KEYS[3])
local items = {}
if depth > 0 and tonumber(ARGV[4]) > 0 then
  items = redis.call('RPOP', KEYS[3], math.min(tonumber(ARGV[4]), depth))
end
-- Bookkeeping through pcall: with nothing popped a full server cannot make an empty poll
-- fail, and with frames popped a foreign type under a bookkeeping key (wake, stats)
-- cannot lose them.
local call = redis.pcall

local wake = 0
if #items > 0 and m[3] and depth >= tonumber(m[3]) then wake = #items end
local floor = tonumber(ARGV[5])
if m[4] and floor > tonumber(m[4]) then
  call('HSET', KEYS[1], 'floor' .. sfx, floor)
  wake = wake + 1
end
if wake > 0 then
  for _ = 1, math.min(wake, 8) do call('LPUSH', KEYS[4], '1') end
  call('LTRIM', KEYS[4], 0, 7)
end
call('HSET', KEYS[1], 'claim_deadline' .. sfx, now + tonumber(ARGV[6]))
local popped = #items + tonumber(ARGV[7])
if popped > 0 then call('HINCRBY', KEYS[5], 'popped', popped) end
local nbytes = tonumber(ARGV[8])
if nbytes > 0 then call('HINCRBY', KEYS[5], 'popped_bytes', nbytes) end
local waited = tonumber(ARGV[9])
if waited > 0 then call('HINCRBY', KEYS[5], 'trainer_wait_ms', waited) end
local busy = tonumber(ARGV[10])
if busy > 0 then call('HINCRBY', KEYS[5], 'trainer_busy_ms', busy) end
local epochs = tonumber(ARGV[11])
if epochs > 0 then call('HINCRBY', KEYS[5], 'epochs_completed', epochs) end
if ARGV[12] ~= '' then
  local i = 0
  for c in string.gmatch(ARGV[12], '[^,]+') do
    if c ~= '0' then call('HINCRBY', KEYS[5], 'wait_bucket:' .. i, tonumber(c)) end
    i = i + 1
  end
end
if ARGV[13] ~= '' then
  local figures = cjson.decode(ARGV[13])
  for field, value in pairs(figures) do call('HSET', KEYS[7], field, tostring(value)) end
  call('HSET', KEYS[7], 'updated_ms', now)
end
if ARGV[14] ~= '' then
  local sample = ARGV[14]
  local ok, s = pcall(cjson.decode, sample)
  if ok and type(s) == 'table' then
    local live = redis.call('ZRANGEBYSCORE', KEYS[6], now, '+inf')
    local built, build_ms = 0, 0
    if #live > 0 and KEYS[9] then  -- a caller of the 8-key layout adds no totals
      local fields = {}
      for _, p in ipairs(live) do
        fields[#fields + 1] = p .. ':batches'
        fields[#fields + 1] = p .. ':produce_ms'
      end
      local v = redis.call('HMGET', KEYS[9], unpack(fields))
      for i = 1, #v, 2 do
        built = built + (tonumber(v[i]) or 0)
        build_ms = build_ms + (tonumber(v[i + 1]) or 0)
      end
    end
    s['producers'] = #live
    s['pushed'] = tonumber(redis.call('HGET', KEYS[5], 'pushed')) or 0
    s['built'] = built
    s['build_ms'] = build_ms
    sample = cjson.encode(s)
  end
  call('LPUSH', KEYS[8], sample)
  call('LTRIM', KEYS[8], 0, 3599)
end
local alive = redis.pcall('ZCOUNT', KEYS[6], now, '+inf')
if type(alive) ~= 'number' then alive = 0 end  -- a foreign type: the frames still go out
return {'OK', alive, depth, items}
