-- lib/shared.lua: what several scripts do, written once; each script is sent with the
-- functions it calls (docs/design.md "Scripts"). No KEYS or ARGV: each script names its own.

-- The server's clock in ms (layout.py's time_ms is the same arithmetic in Python).
local function server_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- A lease entry ('<g>[/<mask>]:<run>:<token>', layout.py): its g as in the entry, its work
-- entry ('<g>[/<mask>]': the shard again for the same groups), its run; nil if malformed.
local function entry_slot(entry)
  return string.match(entry, '^(%d+)[/:]')
end
local function entry_spec(entry)
  return string.match(entry, '^(%d+/?%d*):')
end
local function entry_run(entry)
  return string.match(entry, '^%d+/?%d*:([^:]*):')
end

-- A producer's lease list back to the front of the work list, the entries of `run` only
-- (another run's are dropped: issue 42), each counting a failed attempt with
-- `failures_key` (a dead producer's); the list deleted. Returns how many went back.
local function hand_back_leases(lease_key, work_key, run, failures_key, stats_key)
  local held = redis.call('LRANGE', lease_key, 0, -1)
  local returned = 0
  for j = #held, 1, -1 do
    if run and entry_run(held[j]) == run then
      redis.call('LPUSH', work_key, entry_spec(held[j]))
      if failures_key then redis.call('HINCRBY', failures_key, entry_slot(held[j]), 1) end
      returned = returned + 1
    end
  end
  redis.call('DEL', lease_key)
  if returned > 0 then redis.call('HINCRBY', stats_key, 'redone_shards', returned) end
  if #held > returned then redis.call('HINCRBY', stats_key, 'stale_leases', #held - returned) end
  return returned
end

-- The run whose leases a reap hands back: none once it finished (its work list went).
local function live_run(meta_key)
  local m = redis.call('HMGET', meta_key, 'run', 'finished')
  if m[2] == '1' then return nil end
  return m[1] or nil
end

-- {'WRONG_TYPE', key, type} for the first key of `typed` ({key, type} pairs, KEY_TYPES)
-- of a foreign type, else nil: checked before any write (writes are not rolled back).
local function wrong_type(typed)
  for _, kw in ipairs(typed) do
    local kind = redis.call('TYPE', kw[1]).ok
    if kind ~= kw[2] and kind ~= 'none' then return {'WRONG_TYPE', kw[1], kind} end
  end
  return nil
end

-- {'RUN_CHANGED'} or {'FINISHED'} for a producer's call for `run`, given meta's run and
-- finished (m[1], m[2]); else nil.
local function run_refused(m, run)
  if m[1] ~= run then return {'RUN_CHANGED'} end
  if m[2] == '1' then return {'FINISHED'} end
  return nil
end

-- A producer's heartbeat: {'REAPED'}, writing nothing, once declared dead (it joins
-- again); else its deadline moves and nil.
local function heartbeat(producers_key, producer, deadline_ms)
  if not redis.call('ZSCORE', producers_key, producer) then return {'REAPED'} end
  redis.call('ZADD', producers_key, deadline_ms, producer)
  return nil
end

-- A frame pushed, counted for the queue and the producer (fields.ProducerStat).
local function count_push(stats_key, pstats_key, producer, frame_bytes, produce_ms)
  redis.call('HINCRBY', stats_key, 'pushed', 1)
  redis.call('HINCRBY', stats_key, 'pushed_bytes', frame_bytes)
  redis.call('HINCRBY', pstats_key, producer .. ':batches', 1)
  redis.call('HINCRBY', pstats_key, producer .. ':bytes', frame_bytes)
  redis.call('HINCRBY', pstats_key, producer .. ':produce_ms', produce_ms)
end

-- A shard's last frame pushed: its lease released, the shard counted done.
local function shard_pushed(stats_key, lease_key, entry)
  redis.call('LREM', lease_key, 1, entry)
  redis.call('HINCRBY', stats_key, 'shards_done', 1)
end

-- What a group slot's meta fields (batchq/protocol/groups.py) add to their names: '' for
-- slot 0, '@<slot>' otherwise, then ':<rank>' when the run has several ranks.
local function reader_sfx(slot, rank, world)
  local sfx = ''
  if slot > 0 then sfx = '@' .. slot end
  if world > 1 then sfx = sfx .. ':' .. rank end
  return sfx
end

-- The ranks group slot i reads with (meta 'world' for slot 0, 'world@<i>'), and the most
-- of slots 0..n-1: each group of a run reads with its own world.
local function slot_world(meta_key, i)
  return tonumber(redis.call('HGET', meta_key, 'world' .. reader_sfx(i, 0, 1)) or '1')
end
local function max_world(meta_key, n)
  local w = 1
  for i = 0, math.max(n, 1) - 1 do w = math.max(w, slot_world(meta_key, i)) end
  return w
end

-- Whether group slot i is in a mask (bit i), with doubles: masks have at most 32 bits.
local function mask_has(mask, i)
  return math.floor(mask / 2 ^ i) % 2 == 1
end

-- A work entry (a lease entry's part before its run): '<g>', or '<g>/<mask>' where the
-- shard is for other groups than slot 0 alone.
local function work_spec(g, mask)
  if mask == 1 then return tostring(g) end
  return g .. '/' .. mask
end

-- (g, mask) of a work entry or of a lease entry ('<g>[/<mask>][:<token>]').
local function parse_spec(entry)
  local g, mask = string.match(entry, '^(%d+)/?(%d*)')
  if not g then return nil, nil end
  return tonumber(g), tonumber(mask) or 1  -- no mask: slot 0 alone
end

-- The KEYS tail of claim.lua and resume.lua from index first_tail: group slots
-- 0..max(groups, 1), each slot's keys in a row (QueueKeys.slot_keys for key_world ranks:
-- ledger, counts, `lists` data lists, stats, figures, histories, remap, wake).
-- Returns per (keys a slot has), the slots covered, slot_key(i, j) (slot i's j-th key from
-- 0) and lists; nil when the tail does not cover the caller's `groups`.
local function slot_tail(keys, first_tail, key_world, groups)
  local lists = key_world > 1 and key_world + 1 or key_world
  local per = 5 + 3 * lists
  local tail_slots = (#keys - first_tail + 1) / per
  if tail_slots ~= math.max(groups, 1) + 1 then return nil end
  return per, tail_slots, function(i, j) return keys[first_tail + i * per + j] end, lists
end
