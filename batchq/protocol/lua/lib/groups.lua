-- lib/groups.lua: put after lib/shared.lua before the scripts of runs read by several
-- groups (batchq/protocol/script_files.py: glease, gpush, gclaim, gresume, requeue), so
-- that what they share is written once. No KEYS or ARGV here: each script names its own.

-- What a group slot's meta fields (batchq/protocol/groups.py) add to their names: '' for
-- slot 0, '@<slot>' otherwise, then ':<rank>' when the run has several ranks.
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

-- The KEYS tail of gclaim.lua and gresume.lua, from index first_tail: the keys of group
-- slots 0..max(groups, 1), each slot's in a row (batchq.protocol.keys.QueueKeys.slot_keys
-- for key_world ranks: ledger, counts, data lists, stats, figures, histories, wake list).
-- Returns the keys a slot has, the slots the tail covers and slot_key(i, j) (slot i's j-th
-- key, from 0: its wake list is j = per - 1); nil when the tail does not cover the group
-- slots the caller named (groups).
local function slot_tail(keys, first_tail, key_world, groups)
  local per = 4 + 3 * key_world
  local tail_slots = (#keys - first_tail + 1) / per
  if tail_slots ~= math.max(groups, 1) + 1 then return nil end
  return per, tail_slots, function(i, j) return keys[first_tail + i * per + j] end
end
