-- lib/shared.lua: prepended to every script (batchq/protocol/calls.py), so that what
-- several scripts do is written once. No KEYS or ARGV here: each script names its own.

-- The server's clock in ms (the clock every deadline in Redis uses; batchq/protocol/layout.py's
-- time_ms is the same arithmetic for the TIME command's reply in Python).
local function server_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- The global slot number g of a lease entry '<g>:<token>', or '<g>/<mask>:<token>' in a
-- run of several groups (batchq/protocol/layout.py's entry_slot), as the string it is in
-- the entry; nil for a malformed entry.
local function entry_slot(entry)
  return string.match(entry, '^(%d+)[/:]')
end

-- The part of a lease entry before its token: the work entry that builds its shard again
-- for the same groups ('<g>' or '<g>/<mask>', batchq/protocol/layout.py's work_entry).
local function entry_spec(entry)
  return string.match(entry, '^(%d+/?%d*):')
end

-- Hand every shard of a producer's lease list back to the front of the work list, for
-- the same groups, in the order they were held so that the oldest is redone first, and
-- delete the list. Returns how many went back.
local function hand_back_leases(lease_key, work_key)
  local held = redis.call('LRANGE', lease_key, 0, -1)
  local returned = 0
  for j = #held, 1, -1 do
    local g = entry_spec(held[j])
    if g then
      redis.call('LPUSH', work_key, g)
      returned = returned + 1
    end
  end
  redis.call('DEL', lease_key)
  return returned
end


-- Runs read by several groups (batchq/protocol/groups.py). What a group slot's meta
-- fields add to their names: '' for slot 0, '@<slot>' otherwise, then ':<rank>' when the
-- run has several ranks.
local function reader_sfx(slot, rank, world)
  local sfx = ''
  if slot > 0 then sfx = '@' .. slot end
  if world > 1 then sfx = sfx .. ':' .. rank end
  return sfx
end

-- Whether group slot i is in a mask (bit i), with doubles: masks have at most 32 bits.
local function mask_has(mask, i)
  return math.floor(mask / 2 ^ i) % 2 == 1
end

-- A work entry, or a lease entry's part before its token: '<g>', or '<g>/<mask>' where
-- the shard is for other groups than slot 0 alone.
local function work_spec(g, mask)
  if mask == 1 then return tostring(g) end
  return g .. '/' .. mask
end

-- (g, mask) of a work entry or of a lease entry ('<g>[/<mask>][:<token>]').
local function parse_spec(entry)
  local g, mask = string.match(entry, '^(%d+)/?(%d*)')
  if not g then return nil, nil end
  if mask == '' then return tonumber(g), 1 end
  return tonumber(g), tonumber(mask)
end
