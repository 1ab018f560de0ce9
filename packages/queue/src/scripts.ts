import { MAX_RECORD_BYTES } from "@fleet/contracts";
import { ReplyError } from "ioredis";
import { type RedisConnection, reconnectOnSlotError } from "./connection.ts";

/**
 * Lua scripts for every state change that must be atomic. Rollout hash fields:
 * `meta` (JSON), `deadline` (meta's deadlineAt, for scripts), `status`, `stage`,
 * `r:<stage>` (receipt JSON), `t:<name>` (epoch ms),
 * `failure` (first terminal FailureRecord JSON), `fence` (`launched:<token>` | `stopped`), `fence:prev`
 * (the fence a claim replaced), `vfence` (the token of the verify attempt that began last;
 * `vseen:<token>` marks each token that began, holding its epoch; `vepoch`, the last epoch given), `sfence` / `sseen:<token>` (the same for the
 * seed's deliveries), `t:verify:last` (when a verify attempt last
 * began work in the sandbox), `t:verify:sweep` (until when, by Redis's clock, an attempt
 * handed back may sweep its tests), `cancel` ("1"), `closed` ("1", the tombstone), `result` (JSON).
 *
 * KEYS[2] is the rollout's batch hash, or the rollout hash itself when it has none (ARGV flag).
 */
/** Milliseconds by the clock given (a test's), or by Redis's own (`TIME`) when it is ''. */
const CLOCK = `local function clock(given)
  if given ~= nil and given ~= '' then return tonumber(given) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end`;

/**
 * A hash of per-process entries (`<count>:<expiresAt>`, the fleet's clock), each said again by its
 * process while it lives (`fleetSayEntry`): the sum of the counts of the entries not past their
 * expiry at `now`, but `except`'s (nil: none left out), and the entries past it (a process that
 * died) removed, in the same step: an entry said again between a read and a removal is never
 * removed. A removal refused (a read-only replica) is left for a later count: the expired entries
 * are not counted either way, and a reader (the dispatcher's scrape) gets its count, not an error
 * (`READONLY`, which would also have its connection reconnect).
 */
const LIVE_ENTRIES = `local function liveEntries(key, now, except)
  local all = redis.call('HGETALL', key)
  local live, stale = 0, {}
  for i = 1, #all, 2 do
    if all[i] ~= except then
      local n, expires = string.match(all[i + 1], '^([^:]*):(.*)$')
      n, expires = tonumber(n), tonumber(expires)
      if n and expires and expires > now then
        live = live + math.max(0, n)
      else
        stale[#stale + 1] = all[i]
      end
    end
  end
  -- pcall: a read-only replica (a failover's) refuses the removal, and the count stands.
  if #stale > 0 then redis.pcall('HDEL', key, unpack(stale)) end
  return live
end`;

const TERMINAL = `local terminal = {completed=true, masked=true, failed=true, cancelled=true}`;

/** A script's start that returns 0 for a rollout unknown or terminal (KEYS[1]), and sets `status`. */
const OPEN_OR_RETURN_0 = `${TERMINAL}
      local status = redis.call('HGET', KEYS[1], 'status')
      if not status or terminal[status] then return 0 end`;

/**
 * The fenced launch claim (DESIGN §2 rule 10), shared by `fleetClaimLaunch` and `fleetBegin`,
 * on the rollout's fields as its caller read them (`fence`, `fence:prev`, `launches`, `closed`,
 * `lseen:<token>`, the mark of this token's claim; false when absent), writing through
 * `write(name, value)`: returns 'stopped', 0 when a stop already won; 'superseded', 0 when this
 * token claimed before and the fence has moved on since; else the previous fence ('' for the
 * first launch, 'launched:<token>' on a re-delivery) and the launches so far, this one included.
 */
const CLAIM_LAUNCH = `local function claimLaunch(key, token, fence, prev, launches, closed, seen, write)
        if fence == 'launched:' .. token then
          -- This very claim again (tokens are unique per attempt): ioredis re-sent the command
          -- after a reconnect lost its reply. Answer as the first time, counting no launch.
          return prev or '', tonumber(launches or '1')
        end
        if fence == 'stopped' or closed == '1' then return 'stopped', 0 end
        -- This token claimed before and the fence has moved on (a later delivery claimed it, or
        -- this claim was given back): the claim sent again late (ioredis re-sends one whose reply
        -- a reconnect lost) takes nothing back from the launch that holds it now. (A claim that
        -- first reaches Redis late is refused by its delivery's lapsed lock: fleetBegin.)
        if seen then return 'superseded', 0 end
        write('fence', 'launched:' .. token)
        write('fence:prev', fence or '')
        write('lseen:' .. token, '1')
        return fence or '', redis.call('HINCRBY', key, 'launches', 1)
      end`;

/**
 * A finalized result's teardown marked confirmed, its reward and status as they are (a no-op
 * without a result, or when it is not pending), once neither of the rollout's sandboxes (`key1`,
 * `key2`) may still live (`teardownLeft`: none on the ledger `ledgerKey`, none registered with a
 * handle in `sandboxesKey`) and no gateway network removal of the rollout (`rolloutId`) is left
 * to retry in `networksKey`. Returns 1 if it was edited.
 */
const EDIT_RESULT = `
      -- A finalized result's top-level field \`name\` edited from \`from\` to \`to\` (the text as it
      -- was when it does not hold \`from\` there). Plain string edits, not cjson: cjson would turn
      -- empty arrays into objects. The result is serialised in schema order, and every field
      -- before \`teardown\`, \`failureKind\` and \`usage\` is a scalar or a string (where a quote is
      -- always escaped), so the first occurrence of the key is the top-level field; its value is
      -- edited only if it is the one given (never a same-named field further on, in details or metadata).
      local function editResult(text, name, from, to)
        local i, j = string.find(text, '"' .. name .. '":', 1, true)
        if not i then return text end
        if string.sub(text, j + 1, j + #from) ~= from then return text end
        return string.sub(text, 1, j) .. to .. string.sub(text, j + #from + 1)
      end`;

/**
 * A stopped run's usage (`spent`, JSON) put in a finalized result's top-level usage where it is
 * null (`editResult`), within the record bound (DESIGN §2 rule 13): whole, else with its gaps said
 * as one (`finalizeStored` keeps room for that much in a result whose usage is null), else not at
 * all (a result stored by an earlier release, with no room kept). The text as it was when not edited.
 */
const SPLICE_USAGE = `
      local function spliceUsage(text, spent)
        local edited = editResult(text, 'usage', 'null', spent)
        if edited == text or #edited <= ${MAX_RECORD_BYTES} then return edited end
        local ok, u = pcall(cjson.decode, spent)
        if not ok or type(u) ~= 'table' or type(u.gaps) ~= 'table' or #u.gaps == 0 then return text end
        u.gaps = {#u.gaps .. ' gap(s) of this usage left out, to keep the result within its size bound'}
        edited = editResult(text, 'usage', 'null', cjson.encode(u))
        if #edited <= ${MAX_RECORD_BYTES} then return edited end
        return text
      end`;

const CONFIRM_TEARDOWN = `${EDIT_RESULT}
      -- Whether a sandbox of the rollout (\`key1\`, \`key2\`) may still live: one on the teardown
      -- ledger, or one still registered with a handle (one that replaced a sandbox destroyed
      -- under the same key, its creator gone before its own destroy or still at it; the
      -- janitor's registry step puts it on the ledger).
      local function teardownLeft(ledgerKey, sandboxesKey, key1, key2)
        for _, k in ipairs({key1, key2}) do
          if redis.call('HEXISTS', ledgerKey, k) == 1 then return true end
          local raw = redis.call('HGET', sandboxesKey, k)
          if raw and not string.find(raw, '"handle":null', 1, true) then return true end
        end
        return false
      end
      -- A finalized result that a sandbox attached after it (its creator's create outlived the
      -- close) no longer lets say the teardown is confirmed: turned pending as finalize composes a
      -- pending teardown (a completed result's failureKind says so); the confirm of that
      -- sandbox's destroy turns it back (\`confirmTeardown\`).
      local function pendTeardown(rolloutKey, status)
        local raw = redis.call('HGET', rolloutKey, 'result')
        local edited = raw and editResult(raw, 'teardown', '"confirmed"', '"pending"')
        if raw and edited ~= raw then
          if status == 'completed' then
            edited = editResult(edited, 'failureKind', 'null', '"teardown_failed"')
          end
          redis.call('HSET', rolloutKey, 'result', edited)
        end
      end
      local function confirmTeardown(rolloutKey, ledgerKey, key1, key2, networksKey, rolloutId, sandboxesKey)
        if teardownLeft(ledgerKey, sandboxesKey, key1, key2) then return 0 end
        if redis.call('ZSCORE', networksKey, rolloutId) then return 0 end
        local raw = redis.call('HGET', rolloutKey, 'result')
        if not raw then return 0 end
        local edited = editResult(raw, 'teardown', '"pending"', '"confirmed"')
        if edited == raw then return 0 end
        edited = editResult(edited, 'failureKind', '"teardown_failed"', 'null')
        redis.call('HSET', rolloutKey, 'result', edited)
        return 1
      end`;

/**
 * Forget a confirmed destroy's sandbox entry (`sandboxes`) and ledger entry (`entries`, `due`)
 * under `key`: `only` '' forgets whatever they hold; otherwise only an entry without a handle or,
 * unless `only` is '-', one whose handle id is `only` (the sandbox destroyed). An entry recorded
 * meanwhile for another sandbox under the same key is not this destroy's to forget.
 */
const FORGET_DESTROYED = `local function destroyedOne(raw, only)
        if not raw or only == nil or only == '' then return true end
        local ok, e = pcall(cjson.decode, raw)
        if not ok or type(e) ~= 'table' or type(e.handle) ~= 'table' then return true end
        return only ~= '-' and e.handle.id == only
      end
      local function forgetDestroyed(sandboxes, entries, due, key, only)
        if destroyedOne(redis.call('HGET', sandboxes, key), only) then redis.call('HDEL', sandboxes, key) end
        if destroyedOne(redis.call('HGET', entries, key), only) then
          redis.call('HDEL', entries, key)
          redis.call('ZREM', due, key)
        end
      end`;

/**
 * Record a sandbox intent `json` under `key` in the registry `hash`: 1 when new (no earlier
 * attempt recorded one, so none can have created the sandbox); else 0, and an earlier attempt's
 * intent that never got a handle is re-dated to this one: this attempt may be the one creating
 * the sandbox now, so the intent grace (close or the janitor taking a handle-less intent for
 * "never created") counts from it. One with a handle is the earlier attempt's sandbox: kept.
 */
const RECORD_INTENT = `local function recordIntent(hash, key, json)
        if redis.call('HSETNX', hash, key, json) == 1 then return 1 end
        if string.find(redis.call('HGET', hash, key), '"handle":null', 1, true) then
          redis.call('HSET', hash, key, json)
        end
        return 0
      end`;

/**
 * The rollout fields `fleetBegin` returns before close, in this order: what the stages before
 * close read (not the timings, nor the fences' tokens).
 */
export const BEGIN_FIELDS = [
  "meta",
  "status",
  "stage",
  "failure",
  "cancel",
  "closed",
  "fence",
  "r:seed",
  "r:run",
  "r:verify",
] as const;

/**
 * The rollout fields `fleetBegin` returns for close, in this order: what close reads to compose
 * the result (`composeResult`: the receipts, the launches, the stages' timings), not the fences'
 * tokens nor the times only the other stages read.
 */
export const BEGIN_CLOSE_FIELDS = [
  ...BEGIN_FIELDS,
  "launches",
  "result",
  "r:close",
  "t:seed:start",
  "t:seed:end",
  "t:run:start",
  "t:run:end",
  "t:verify:start",
  "t:verify:end",
  "t:close:start",
] as const;

/** Names as a Lua list's items. */
function luaList(names: readonly string[]): string {
  return names.map((n) => `'${n}'`).join(", ");
}

/**
 * `fleetBegin`'s HMGET by the kind of begin (its stage; close or not; with an intent key or not;
 * with a token or not), worked out once per kind and script call (a batch's items share it):
 * `names`, the fields it reads, the returned ones (`BEGIN_FIELDS` or `BEGIN_CLOSE_FIELDS`) first,
 * then the others the begin checks, each once (`want`); `at`, where each is; `i<Field>`, where
 * the fields the begin checks by name are (nil when not read). A seed's or verify's token field
 * (`seen` .. token, the token's own) has the slot `iSeen`, a run's launch token's mark
 * (`lseen:` .. token) the slot `iLseen`, filled in by each begin before its HMGET. Compact
 * (lines shared): fleetBegin's body keeps the line numbers its errors report.
 */
const BEGIN_SHAPES = `local shapes = {}
      local function shapeOf(stage, close, withIntent, withToken)
        local byKind = shapes[stage] or {}
        local kind = (close and 4 or 0) + (withIntent and 2 or 0) + (withToken and 1 or 0)
        if byKind[kind] then return byKind[kind] end
        local names
        if close then names = {${luaList(BEGIN_CLOSE_FIELDS)}} else names = {${luaList(BEGIN_FIELDS)}} end
        local at = {}
        for i, name in ipairs(names) do at[name] = i end
        local s = {names = names, at = at, returned = #names}
        local function want(name)
          if not at[name] then names[#names + 1] = name; at[name] = #names end
          return at[name]
        end
        s.iStart = want('t:' .. stage .. ':start'); s.iReceipt = want('r:' .. stage)
        if not close and withIntent then s.iDeadline = want('deadline') end
        if not close and withToken and (stage == 'seed' or stage == 'verify') then
          s.seen = stage == 'seed' and 'sseen:' or 'vseen:'; s.iSeen = #names + 1; names[s.iSeen] = ''
        elseif not close and withToken then
          s.iPrev = want('fence:prev'); s.iLaunches = want('launches'); s.iRunDeadline = want('deadline')
          s.iLseen = #names + 1; names[s.iLseen] = ''
        end
        if not close and stage == 'verify' then
          s.iLast = want('t:verify:last'); s.iSweep = want('t:verify:sweep'); s.iNote = want('vnote')
          s.iAware = want('vaware')
          if withToken then s.iEpoch = want('vepoch') end
        end
        byKind[kind], shapes[stage] = s, byKind
        return s
      end`;

/** A batched item's error in its reply slot: `{BATCH_ERROR, message}` (see `BATCHED`, `fleetAdmit`). */
export const BATCH_ERROR = "__fleet_err";

/**
 * The error a batched item's reply slot holds (`{BATCH_ERROR, message}`), as the plain script
 * alone would have rejected: a ReplyError with Redis's message, by which callers tell a Redis
 * that cannot serve now (READONLY after a failover, NOREPLICAS, OOM: `isRedisUnavailable`, the
 * dispatcher's 503) from an error that will not pass. Null for a slot holding a reply. The
 * connection the reply came on (`via`) reconnects for it where ioredis would have for the plain
 * script's reply (`reconnectOnSlotError`: a READONLY).
 */
export function slotError(slot: unknown, via: RedisConnection): Error | null {
  if (!Array.isArray(slot) || slot[0] !== BATCH_ERROR) return null;
  const err: Error = new ReplyError(String(slot[1]));
  reconnectOnSlotError(via, err);
  return err;
}

/**
 * A batched script (`BATCHED`) in two parts: `prelude`, the helpers it defines (constant tables
 * and functions that take everything of an item as parameters), and `body`, the rest. The single
 * form is the two in a row; the batched one defines the helpers once per call, not once per item
 * (each item's body sees them as upvalues).
 */
function withPrelude(prelude: string, body: string): { prelude: string; body: string; lua: string } {
  return { prelude, body, lua: prelude + body };
}

const SCRIPTS = {
  /**
   * Admit the rollouts of one admission in their order, each if new: meta, status, inflight entry,
   * and a batch's count and id list. All of one batch (ARGV[2] 'batch'), or single rollouts
   * ('single'; 'keyed': their idempotency key names the batch KEYS[3]). Per rollout: 1 if created,
   * 2 if this very call created it (sent again by ioredis after a reconnect lost its reply), 0 if
   * it existed with the same body hash (an idempotent replay), -1 if it existed with another
   * (a conflicting reuse of the id's idempotency key, however close together the two requests
   * came), -2 if it is gone from a batch that finished and is expiring (retention): a replay may
   * not add it again, which would count it twice in a batch about to vanish (0 if it is gone from
   * a batch still running: it finished early and its own retention ended; not added again
   * either); -3 if its idempotency key names a batch (KEYS[3]) already; `{'__fleet_err', message}`
   * if its commands failed (the others are unaffected, as separate calls would be).
   * A batch's admission is noted as under way in `admitting` (KEYS[2]) with the score ARGV[3] and
   * the member ARGV[4] (`fleetCreateBatch` noted it first: a long admission keeps its note fresh,
   * so the janitor finishes only one left for dead); a single rollout created, as `r:<id>`.
   * One call for many rollouts: the batch's state is read once and its count, id list and the
   * inflight entries are written once, for all of them (each rollout's own call ran 11 commands).
   */
  fleetAdmit: {
    // inflight, admitting, batch|the batch the singles' key names|inflight, batchIds|inflight,
    // batchDone|inflight, then per rollout: its hash, its failure log.
    // ARGV: now, mode, note score, note member, then per rollout: metaJson, deadlineAt, id,
    // bodyHash; last, this call's id (recorded as each rollout's 'admittedBy') and the results'
    // retention in ms (recorded as each rollout's 'ttl').
    keys: null,
    lua: `
      local now, mode = ARGV[1], ARGV[2]
      local callId, ttl = ARGV[#ARGV - 1], ARGV[#ARGV]
      local batched = mode == 'batch'
      -- The batch's state, read once: nothing else runs meanwhile, and what this call changes of
      -- it is kept here as it goes (\`total\`: its rollouts admitted so far, nil before the first).
      local total, cancelled, expiring = nil, false, false
      if batched then
        local b = redis.call('HMGET', KEYS[3], 'total', 'cancel')
        total = tonumber(b[1])
        cancelled = b[2] == '1'
        -- A batch that counted rollouts and has a TTL is finished and expiring (a batch gets one
        -- only from fleetFinalize once done reaches total, or, before its first admission, from
        -- fleetCreateBatch: that lease is not the end of it).
        expiring = total ~= nil and redis.call('PTTL', KEYS[3]) > 0
      end
      local function admitOne(key, failures, meta, deadline, id, bodyHash)
        if redis.call('HEXISTS', key, 'meta') == 1 then
          local stored = redis.call('HMGET', key, 'bodyHash', 'admittedBy')
          if stored[1] and stored[1] ~= bodyHash then return -1 end
          -- Made by this very call, sent again (a reconnect lost its reply): created (2: counted
          -- already), not a replay.
          if stored[2] == callId then return 2 end
          return 0
        end
        -- A single rollout's key that names a batch already (sent on the other route): -3. Checked
        -- here, with the write, so two requests on the two routes cannot both pass.
        if mode == 'keyed' and redis.call('EXISTS', KEYS[3]) == 1 then return -3 end
        -- A rollout of a finished, expiring batch that was never admitted (one cut short: its
        -- dispatcher died, and the rollouts it had admitted finished) comes now, a replay
        -- finishing that admission, and the batch lives as long as it does.
        -- Every admission records a batch's rollouts in their order (ids end in -<index>), so those
        -- ever admitted are the first 'total' of them.
        -- One of those first 'total' with no record is gone (its retention ended), whether or not
        -- its batch is expiring: a batch still running keeps its rollouts that finished early only
        -- for their own retention. Admitted again it would run twice and count twice: never. A
        -- batch still running answers its replay as it is (0, as for one that exists).
        if batched and total ~= nil then
          local index = tonumber(string.match(id, '%-(%d+)$') or '0')
          if index < total then
            if expiring then return -2 end
            return 0
          end
          if expiring then
            redis.call('PERSIST', KEYS[3])
            redis.call('PERSIST', KEYS[4])
            redis.call('PERSIST', KEYS[5])
            expiring = false
          end
        end
        -- A failure log left by an expired rollout of the same id (a late stage's append) is not this one's.
        redis.call('DEL', failures)
        if cancelled then
          -- The batch was cancelled while it was being admitted: so is this rollout (its seed stops it).
          redis.call('HSET', key, 'meta', meta, 'status', 'accepted', 'stage', 'admission', 't:accepted', now, 'deadline', deadline, 'bodyHash', bodyHash, 'ttl', ttl, 'admittedBy', callId, 'cancel', '1', 'fence', 'stopped')
        else
          redis.call('HSET', key, 'meta', meta, 'status', 'accepted', 'stage', 'admission', 't:accepted', now, 'deadline', deadline, 'bodyHash', bodyHash, 'ttl', ttl, 'admittedBy', callId)
        end
        return 1
      end
      local out, inflight, ids = {}, {}, {}
      for i = 1, (#KEYS - 5) / 2 do
        local a = 4 + (i - 1) * 4
        local id, deadline = ARGV[a + 3], ARGV[a + 2]
        local ok, r = pcall(admitOne, KEYS[4 + 2 * i], KEYS[5 + 2 * i], ARGV[a + 1], deadline, id, ARGV[a + 4])
        if ok then
          out[i] = r
          if r == 1 then
            inflight[#inflight + 1] = deadline
            inflight[#inflight + 1] = id
            ids[#ids + 1] = id
            if batched then total = (total or 0) + 1 end
          end
        else
          out[i] = {'${BATCH_ERROR}', tostring(r)}
        end
      end
      if #ids > 0 then
        redis.call('ZADD', KEYS[1], unpack(inflight))
        if batched then
          redis.call('HINCRBY', KEYS[3], 'count:accepted', #ids)
          -- Its first rollouts: the batch lives as long as its rollouts now (its creation's lease ends).
          if redis.call('HINCRBY', KEYS[3], 'total', #ids) == #ids then redis.call('PERSIST', KEYS[3]) end
          redis.call('RPUSH', KEYS[4], unpack(ids))
        else
          -- Under way until its seed is enqueued (a batch's admission is noted by fleetCreateBatch).
          local notes = {}
          for _, id in ipairs(ids) do
            notes[#notes + 1] = now
            notes[#notes + 1] = 'r:' .. id
          end
          redis.call('ZADD', KEYS[2], unpack(notes))
        end
      end
      if batched then redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4]) end
      return out`,
  },
  /**
   * Create a batch hash if new: its body hash and creation time, and a lease of ARGV[3] ms that
   * its first admitted rollout ends (`fleetAdmit`), so a batch none of whose rollouts was ever
   * recorded (its dispatcher died, or Redis went away, between the two) does not stay for good.
   * For its own body, the admission is noted as under way (`admitting`). ARGV: bodyHash, now,
   * leaseMs, admitting member, the note's time. Returns the stored body hash. Never writes the counts (admission and finalize count them up), so a late
   * creation cannot reset a replay's.
   */
  fleetCreateBatch: {
    // batch, admitting, the single rollout its idempotency key would name|batch, its finish-order list|batch
    keys: 4,
    lua: `
      -- The key names a single rollout already (sent on the other route): nothing created.
      if KEYS[3] and KEYS[3] ~= KEYS[1] and redis.call('EXISTS', KEYS[3]) == 1 then return '@other-route' end
      if redis.call('HSETNX', KEYS[1], 'bodyHash', ARGV[1]) == 1 and redis.call('HEXISTS', KEYS[1], 'total') == 0 then
        redis.call('PEXPIRE', KEYS[1], ARGV[3])
        -- A new batch: a finish-order list left by an earlier one of the same id (one that an
        -- older release's finalize let outlive its batch) is not this one's.
        if KEYS[4] and KEYS[4] ~= KEYS[1] then redis.call('DEL', KEYS[4]) end
      end
      redis.call('HSETNX', KEYS[1], 'createdAt', ARGV[2])
      local stored = redis.call('HGET', KEYS[1], 'bodyHash')
      -- Its admission is under way until its seeds are enqueued (ARGV[4]: its member there,
      -- ARGV[5]: the note's time).
      if stored == ARGV[1] then redis.call('ZADD', KEYS[2], ARGV[5] or ARGV[2], ARGV[4]) end
      return stored`,
  },
  /**
   * Store a stage receipt and move status, unless terminal (or closed, for non-close stages).
   * With an attach key, first store a created sandbox's entry (handle included) in the sandboxes
   * hash whatever the status, so a close or the janitor can find it; one attached to a finalized
   * rollout turns its result's teardown pending (a close that finalized first could not see it).
   * Returns 1 if stored.
   * A receipt is written once: a second attempt of the stage that ran alongside the first (its
   * lock lapsed) is refused (2) before it attaches anything, so it cannot replace the sandbox the
   * next stage already uses; it destroys its own sandbox. The same receipt sent again (ioredis
   * resends a command whose reply a reconnect lost) is stored already: 1. A fenced receipt whose
   * fence another holds is refused (3) before it attaches anything.
   */
  fleetReceipt: {
    keys: 3, // rollout, batch|rollout, sandboxes
    // ARGV: field, receiptJson, newStatus, stage, timeField, now, hasBatch, allowClosed,
    //       attachKey ('' for none), attachJson, fence value ('' for none), fence field: the
    //       receipt is stored only while the fence field holds that value (a run's while its
    //       launch holds 'fence', DESIGN §2 rule 10; a verify's while it is the attempt that
    //       began last, 'vfence'; a seed's likewise, 'sfence')
    ...withPrelude(
      `
      ${TERMINAL}
      ${CONFIRM_TEARDOWN}`,
      `
      -- The fields checked below, read in one HMGET before anything is written (the attach
      -- writes another key).
      local names = {ARGV[1], 'status', 'closed'}
      if ARGV[11] ~= '' then names[4] = ARGV[12] end
      local v = redis.call('HMGET', KEYS[1], unpack(names))
      local stored, status = v[1], v[2]
      if stored then
        if stored == ARGV[2] then return 1 end
        return 2
      end
      -- Fenced and the fence is another's (a later delivery of the stage began): 3, before the
      -- attach, so the registry entry stays the later delivery's. (A record gone is refused as
      -- below: its creator destroys the sandbox.)
      if ARGV[11] ~= '' and v[4] ~= ARGV[11] and redis.call('EXISTS', KEYS[1]) == 1 then return 3 end
      if ARGV[9] ~= '' then redis.call('HSET', KEYS[3], ARGV[9], ARGV[10]) end
      if not status or terminal[status] then
        -- Finalized already (a close ran while this stage made its sandbox, and could not see
        -- it): the sandbox attached now lives until its creator's destroy (or, its worker dead,
        -- the janitor's) is confirmed, so the result cannot say the teardown is confirmed.
        if status and ARGV[9] ~= '' and not string.find(ARGV[10], '"handle":null', 1, true) then
          pendTeardown(KEYS[1], status)
        end
        return 0
      end
      if ARGV[8] ~= '1' and v[3] == '1' then return 0 end
      -- A grade after a terminal failure (the watchdog's deadline, a cancel) is refused as a
      -- grade before it refuses the failure (fleetSetField's mode 2): the failure decides the
      -- result, and the record must not show a reward the result never reports.
      if ARGV[1] == 'r:verify' and redis.call('HEXISTS', KEYS[1], 'failure') == 1 then return 0 end
      -- The receipt, the stage, its time and (when it moves) the status, in one write.
      if status ~= ARGV[3] then
        redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 'stage', ARGV[4], ARGV[5], ARGV[6], 'status', ARGV[3])
        if ARGV[7] == '1' then
          redis.call('HINCRBY', KEYS[2], 'count:' .. status, -1)
          redis.call('HINCRBY', KEYS[2], 'count:' .. ARGV[3], 1)
        end
      else
        redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], 'stage', ARGV[4], ARGV[5], ARGV[6])
      end
      return 1`,
    ),
  },
  /**
   * Set a field unless the rollout is terminal. ARGV: field, value, mode: '0' always, '1' only if
   * absent, '2' only if absent and the rollout is neither closing nor graded (its result is
   * decided already); optionally a fence field and the value it must hold (e.g. 'vfence' and a
   * verify attempt's token), '' '' for none; optionally this call's id, kept with what modes 1
   * and 2 set (`<field>:by`). Returns 1 if set, also to the call that set it sent again.
   */
  fleetSetField: {
    keys: 1,
    lua: `
      ${OPEN_OR_RETURN_0}
      -- This very call again (ioredis re-sent it after a reconnect lost its reply; ARGV[6], its
      -- id, kept with the value it set): answered as the first time, set, whatever its fence
      -- holds since (a cancel may have stopped a run's launch meanwhile). (Not by the value: two
      -- callers may write the same one, e.g. two cancels in one millisecond.)
      local by = ARGV[1] .. ':by'
      if ARGV[3] ~= '0' and ARGV[6] and ARGV[6] ~= '' and redis.call('HGET', KEYS[1], by) == ARGV[6] then return 1 end
      if ARGV[4] and ARGV[4] ~= '' and redis.call('HGET', KEYS[1], ARGV[4]) ~= ARGV[5] then return 0 end
      if ARGV[3] == '2' and (redis.call('HEXISTS', KEYS[1], 'closed') == 1
          or redis.call('HEXISTS', KEYS[1], 'r:verify') == 1) then return 0 end
      if ARGV[3] ~= '0' then
        if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
        if ARGV[6] and ARGV[6] ~= '' then redis.call('HSET', KEYS[1], by, ARGV[6]) end
        return 1
      end
      redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
      return 1`,
  },
  /**
   * Finalize exactly once, storing the close receipt with the result. ARGV: resultJson,
   * newStatus, now, hasBatch, rolloutId, closeReceiptJson ('' for none), two sandbox keys whose
   * destroy is confirmed ('' for none): they leave the sandboxes hash and the teardown ledger
   * whether or not this call finalizes; then the rollout's two sandbox keys. A result stored with
   * its teardown pending is stored confirmed when the ledger holds neither sandbox by now (the
   * janitor finished the teardown while this close ran, and no network removal is left to retry:
   * KEYS[9]). ARGV[11]: retention (ms, 0 for good);
   * ARGV[12]: this call's id, stored with the result. Returns 1 if this call finalized, also when
   * it is the same call sent again (ioredis re-sends one whose reply a reconnect lost), 2 when it
   * finalized with the result's teardown turned pending (a sandbox left, above), 3 when it
   * finalized with it turned confirmed (none left), 0 if not.
   */
  fleetFinalize: {
    // rollout, batch|rollout, inflight, sandboxes, teardown entries, teardown due, failures,
    // batch ids|rollout, network retries, batch done|rollout
    keys: 10,
    ...withPrelude(
      `
      ${TERMINAL}
      ${CONFIRM_TEARDOWN}
      ${SPLICE_USAGE}
      ${FORGET_DESTROYED}`,
      `
      -- ARGV[13], ARGV[14]: which sandbox's destroy confirmed ARGV[7], ARGV[8] (see forgetDestroyed).
      local given = ARGV[1]
      for i = 7, 8 do
        if ARGV[i] ~= '' then forgetDestroyed(KEYS[4], KEYS[5], KEYS[6], ARGV[i], ARGV[i + 6] or '') end
      end
      -- A sandbox left under either key (recorded meanwhile for one that replaced the sandbox this
      -- close destroyed): the result cannot say the teardown is confirmed.
      local turnedPending = false
      if teardownLeft(KEYS[5], KEYS[4], ARGV[9], ARGV[10]) then
        -- (As result.ts composes a pending teardown: a completed result's failureKind says so,
        -- unless the agent's timeout already does.)
        local edited = editResult(ARGV[1], 'teardown', '"confirmed"', '"pending"')
        turnedPending = edited ~= ARGV[1]
        if edited ~= ARGV[1] and ARGV[2] == 'completed' then
          edited = editResult(edited, 'failureKind', 'null', '"teardown_failed"')
        end
        ARGV[1] = edited
        if ARGV[6] ~= '' then ARGV[6] = editResult(ARGV[6], 'teardown', '"confirmed"', '"pending"') end
      end
      local status = redis.call('HGET', KEYS[1], 'status')
      if not status or terminal[status] then
        -- A closer that lost the race may still have confirmed the last teardown just now.
        confirmTeardown(KEYS[1], KEYS[5], ARGV[9], ARGV[10], KEYS[9], ARGV[5], KEYS[4])
        -- This very call sent again (a reconnect lost its reply): it did finalize, and answers
        -- with the teardown its result holds now against the one it was given (2: turned
        -- pending, 3: turned confirmed), as the caller's copy must say what is stored.
        if status and redis.call('HGET', KEYS[1], 'finalizer') == ARGV[12] then
          local stored = redis.call('HGET', KEYS[1], 'result') or given
          local function pending(text) return editResult(text, 'teardown', '"pending"', '') ~= text end
          if pending(stored) and not pending(given) then return 2 end
          if pending(given) and not pending(stored) then return 3 end
          return 1
        end
        return 0
      end
      -- What a run stopped by this close spent, stored before this finalize (fleetStoppedRunUsage:
      -- a stopped run stores no receipt): the result says it, as one finalized already is edited to.
      -- Only a usage kept by the rollout's last launch ('u:run:launch' at 'launches', both always
      -- written with it) and no run receipt: one handed back at a shutdown kept its spend, then its
      -- rollout ran again (a receipt, a failure, a stop whose write failed, a worker that died):
      -- the result's usage is the later launch's, null when it measured none.
      if string.find(ARGV[1], '"usage":null', 1, true) then
        local u = redis.call('HMGET', KEYS[1], 'u:run', 'u:run:launch', 'launches', 'r:run')
        if u[1] and not u[4] and u[2] == u[3] then ARGV[1] = spliceUsage(ARGV[1], u[1]) end
      end
      redis.call('HSET', KEYS[1], 'status', ARGV[2], 'stage', 'close', 'result', ARGV[1], 't:finished', ARGV[3], 'closed', '1', 'finalizer', ARGV[12])
      if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'r:close', ARGV[6], 't:close:end', ARGV[3]) end
      redis.call('ZREM', KEYS[3], ARGV[5])
      local turnedConfirmed = confirmTeardown(KEYS[1], KEYS[5], ARGV[9], ARGV[10], KEYS[9], ARGV[5], KEYS[4]) == 1
      local done, total = 0, 1
      if ARGV[4] == '1' then
        redis.call('HINCRBY', KEYS[2], 'count:' .. status, -1)
        redis.call('HINCRBY', KEYS[2], 'count:' .. ARGV[2], 1)
        done = redis.call('HINCRBY', KEYS[2], 'done', 1)
        total = tonumber(redis.call('HGET', KEYS[2], 'total') or '0')
        -- In the order they finish: the results cursor (GET …/results?after=n) reads from here.
        redis.call('RPUSH', KEYS[10], ARGV[5])
      end
      -- Retention: the result and its failure log live ttl ms from now; a batch's keys from
      -- when its last rollout finished (its seeds are enqueued only once all are admitted). The
      -- dispatcher's, recorded at admission (it serves the results); this process's (ARGV[11])
      -- for a rollout admitted by a release before that. 0: kept, the failure log too (a stage
      -- appending to it set its expiry by its own process's retention).
      local ttl = tonumber(redis.call('HGET', KEYS[1], 'ttl') or ARGV[11]) or 0
      if ttl > 0 then
        redis.call('PEXPIRE', KEYS[1], ttl)
        redis.call('PEXPIRE', KEYS[7], ttl)
      else
        redis.call('PERSIST', KEYS[7])
      end
      if ARGV[4] == '1' then
        -- A batch outlives each of its rollouts: it keeps the longest retention among them ('ttl'
        -- on the batch, '0' for good), not the last one's to finish. Its rollouts may have been
        -- admitted by dispatchers of different retentions (a rolling restart mid-admission): gone
        -- before a rollout still kept, a replay of its key would make a new batch and run the
        -- rollouts already expired again.
        local kept = redis.call('HGET', KEYS[2], 'ttl')
        if kept ~= '0' and (ttl <= 0 or not kept or tonumber(kept) < ttl) then
          kept = ttl > 0 and tostring(ttl) or '0'
          redis.call('HSET', KEYS[2], 'ttl', kept)
        end
        if done >= total and kept ~= '0' then
          redis.call('PEXPIRE', KEYS[2], kept)
          redis.call('PEXPIRE', KEYS[8], kept)
          redis.call('PEXPIRE', KEYS[10], kept)
        end
      end
      if turnedPending then return 2 end
      if turnedConfirmed then return 3 end
      return 1`,
    ),
  },
  /**
   * Persist a sandbox intent before creating it (DESIGN §2 rule 9), refused when the rollout is
   * closed (tombstone) or terminal. ARGV: sandboxKey, entryJson. Returns 'ok' | 'closed' | 'missing'.
   */
  fleetIntent: {
    keys: 2, // rollout, sandboxes
    lua: `
      ${TERMINAL}
      ${RECORD_INTENT}
      local status = redis.call('HGET', KEYS[1], 'status')
      if not status then return 'missing' end
      if terminal[status] or redis.call('HGET', KEYS[1], 'closed') == '1' then return 'closed' end
      recordIntent(KEYS[2], ARGV[1], ARGV[2])
      return 'ok'`,
  },
  /**
   * Reserve room for `n` rollouts under the backlog bound, atomically with the check, so that
   * concurrent submissions cannot together pass it: rollouts in flight plus live reservations
   * plus `n` must not exceed `max`. ARGV: reservationId, n, max, now ('' for Redis's clock, so
   * every dispatcher's reservations lapse by one clock), ttlMs. Returns
   * [1 reserved | 0 refused, in flight, reserved by others].
   */
  fleetReserve: {
    keys: 2, // inflight, reservations
    // ARGV: id, count, max, now ('' for TIME), ttlMs, share ('' for none)
    lua: `
      ${CLOCK}
      local now = clock(ARGV[4])
      redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%.0f', now))
      local share = ARGV[6] or ''
      local own = ARGV[1] .. ':' .. (share ~= '' and (share .. ':') or '') .. ARGV[2]
      local shareTag = ':' .. share .. ':'
      local reserved, mine, shared = 0, false, false
      for _, member in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
        -- Its own member: this reservation re-sent by ioredis after a reconnect lost the reply
        -- (ids are unique per call). It holds already; counting it as another's would refuse it.
        if member == own then mine = true
        else
          reserved = reserved + tonumber(string.match(member, ':(%d+)$'))
          -- The same request (its idempotency key) being admitted by another call: its room is
          -- reserved already, and this one admits the same rollouts (a replay, never refused).
          if share ~= '' and string.find(member, shareTag, 1, true) then shared = true end
        end
      end
      local inflight = redis.call('ZCARD', KEYS[1])
      if mine then return {1, inflight, reserved, 0} end
      if shared then return {1, inflight, reserved, 1} end
      if inflight + reserved + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return {0, inflight, reserved, 0} end
      redis.call('ZADD', KEYS[2], string.format('%.0f', now + tonumber(ARGV[5])), own)
      return {1, inflight, reserved, 0}`,
  },
  /**
   * Move a rollout from the in-flight index (KEYS[1]) to the unreadable one (KEYS[2]), its score
   * (deadline) kept. ARGV: rolloutId. Returns 1 if it was in flight.
   */
  fleetSetAside: {
    keys: 2,
    lua: `
      local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
      if not score then return 0 end
      redis.call('ZADD', KEYS[2], score, ARGV[1])
      redis.call('ZREM', KEYS[1], ARGV[1])
      return 1`,
  },
  /**
   * Retire a registry entry that does not parse: moved as it is from the registry (KEYS[1]) to
   * the retired hash (KEYS[2]), unless it changed since it was read (ARGV[2], its text) or the
   * ledger (KEYS[3]) has the key; then the rollout's (KEYS[4]) finalized result's teardown is
   * confirmed if nothing else of it is left (network retries KEYS[5]). ARGV: key, text, key1,
   * key2, rolloutId. Returns 1 if retired.
   */
  fleetRetireUnreadable: {
    keys: 5,
    lua: `
      ${CONFIRM_TEARDOWN}
      if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
      if redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then return 0 end
      redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
      redis.call('HDEL', KEYS[1], ARGV[1])
      confirmTeardown(KEYS[4], KEYS[3], ARGV[3], ARGV[4], KEYS[5], ARGV[5], KEYS[1])
      return 1`,
  },
  /**
   * Keep a backlog reservation (`fleetReserve`) alive while its admission goes on: its expiry
   * moved to now + ttlMs, if it is still there (not lapsed, not released). ARGV: member, now (''
   * for Redis's clock), ttlMs. Returns 1 if refreshed.
   */
  fleetReserveRefresh: {
    keys: 1, // reservations
    lua: `
      ${CLOCK}
      if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
      redis.call('ZADD', KEYS[1], string.format('%.0f', clock(ARGV[2]) + tonumber(ARGV[3])), ARGV[1])
      return 1`,
  },
  /**
   * Tombstone: no seed may create a sandbox after this. Returns the previous fence; '' and nothing
   * written for a rollout with no record (a bare hash there would have no TTL, and stay for good).
   */
  fleetTombstone: {
    keys: 1,
    lua: `
      if redis.call('EXISTS', KEYS[1]) == 0 then return '' end
      local fence = redis.call('HGET', KEYS[1], 'fence')
      redis.call('HSET', KEYS[1], 'closed', '1', 'fence', 'stopped')
      return fence or ''`,
  },
  /** Fenced launch (DESIGN §2 rule 10). ARGV: token. Returns [previous, launches] (see `CLAIM_LAUNCH`). */
  fleetClaimLaunch: {
    keys: 1,
    lua: `
      ${CLAIM_LAUNCH}
      local f = redis.call('HMGET', KEYS[1], 'fence', 'fence:prev', 'launches', 'closed', 'lseen:' .. ARGV[1])
      local previous, launches = claimLaunch(KEYS[1], ARGV[1], f[1], f[2], f[3], f[4], f[5], function(name, value)
        redis.call('HSET', KEYS[1], name, value)
      end)
      return {previous, launches}`,
  },
  /**
   * Undo a launch claim whose harness never started (its stage failed before launching): the
   * fence goes back to what the claim found (ARGV[2], '' for none), so the next attempt is not
   * taken for a rerun after an agent ran. Only while the claim (ARGV[1], the token) still holds.
   * Returns 1 if released.
   */
  fleetReleaseLaunch: {
    keys: 1,
    lua: `
      if redis.call('HGET', KEYS[1], 'fence') ~= 'launched:' .. ARGV[1] then return 0 end
      if ARGV[2] == '' then redis.call('HDEL', KEYS[1], 'fence') else redis.call('HSET', KEYS[1], 'fence', ARGV[2]) end
      redis.call('HDEL', KEYS[1], 'fence:prev')
      redis.call('HINCRBY', KEYS[1], 'launches', -1)
      return 1`,
  },
  /**
   * What a run stopped by a close (a cancel, the rollout's deadline) had spent: its model usage
   * (ARGV[1], JSON). A stopped run stores no receipt, so its result said nothing of the tokens its
   * agent did spend. Kept in 'u:run' for a close still to finalize (\`fleetFinalize\` puts it in
   * the result), and put in a result finalized already whose usage is null. Nothing for a rollout
   * gone (no record is made again) or one whose run receipt holds its usage, nor from a launch
   * that is not the rollout's last (ARGV[2], its token, never claimed on this record: a rollout
   * admitted again under the same id; ARGV[3], its launch number, not the count: another launch
   * took the run over, and a stop reads before a lost fence). Returns 0 for nothing written, 1
   * kept for the close, 2 put in the result, 3 kept while the result says another usage.
   */
  fleetStoppedRunUsage: {
    keys: 1,
    lua: `${EDIT_RESULT}
      ${SPLICE_USAGE}
      local f = redis.call('HMGET', KEYS[1], 'status', 'r:run', 'result', 'lseen:' .. ARGV[2], 'launches')
      if not f[1] or f[2] then return 0 end
      if not f[4] or f[5] ~= ARGV[3] then return 0 end
      redis.call('HSET', KEYS[1], 'u:run', ARGV[1], 'u:run:launch', ARGV[3])
      if not f[3] then return 1 end
      local edited = spliceUsage(f[3], ARGV[1])
      if edited == f[3] then return 3 end
      redis.call('HSET', KEYS[1], 'result', edited)
      return 2`,
  },
  /**
   * Cancel a batch's rollouts still to come: those its admission records from now on are
   * recorded cancelled (`fleetAdmit`); and note the cancel under way (ARGV: batch id, now), in
   * one step: a batch marked cancelled is noted until its walk is done. Returns 1, or 0 for no
   * such batch (nothing created).
   */
  fleetCancelBatch: {
    keys: 2, // batch, cancelling
    lua: `
      if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
      redis.call('HSET', KEYS[1], 'cancel', '1')
      redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
      return 1`,
  },
  /**
   * A failure log (KEYS[1]) appended to by a process with retention off: it expires with its
   * rollout (KEYS[2]) when that has an expiry (finalized by a release with retention), not never;
   * a rollout gone (expired so) takes the log with it, which nothing could read or expire after.
   */
  fleetFailuresFollow: {
    keys: 2,
    lua: `
      local left = redis.call('PTTL', KEYS[2])
      if left > 0 then redis.call('PEXPIRE', KEYS[1], left) end
      if left == -2 then redis.call('DEL', KEYS[1]) end
      return left`,
  },
  /**
   * A note (an admission's, a batch cancel's) removed only while it has the score read (ARGV:
   * member, score). Returns 1 if removed.
   */
  fleetNoteDone: {
    keys: 1, // admitting, or cancelling
    lua: `
      local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
      if score and tonumber(score) == tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
      return 0`,
  },
  /**
   * A live stage's heartbeat (ARGV: field, time): stamped on an open rollout only, never on a
   * record gone (HSET would make a key of its own, without the record's TTL). Returns 1 if stamped.
   */
  fleetBeat: {
    keys: 1,
    lua: `
      if not redis.call('HGET', KEYS[1], 'status') then return 0 end
      if redis.call('HGET', KEYS[1], 'closed') == '1' then return 0 end
      redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
      return 1`,
  },
  /**
   * A process says its entry in a hash of per-process entries (ARGV: its field, `<count>:
   * <expiresAt>`, the hash's time to live in ms): a seed-ahead bound's seeds, a worker's
   * presence. The hash's expiry is only lengthened (a shorter one, from a process saying on a
   * shorter interval, would drop every other entry with it); with ARGV[4] (the fleet's now) also
   * reads the others' counts and removes the entries past their expiry (`LIVE_ENTRIES`). Returns
   * the others' counts (0 without ARGV[4]).
   */
  fleetSayEntry: {
    keys: 1,
    lua: `
      ${LIVE_ENTRIES}
      redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
      local ttl = tonumber(ARGV[3])
      if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
      if not ARGV[4] then return 0 end
      return liveEntries(KEYS[1], tonumber(ARGV[4]), ARGV[1])`,
  },
  /**
   * Every process's count in a hash of per-process entries (`fleetSayEntry`) at ARGV[1] (the
   * fleet's now), the entries past their expiry removed (`LIVE_ENTRIES`).
   */
  fleetCountEntries: {
    keys: 1,
    lua: `
      ${LIVE_ENTRIES}
      return liveEntries(KEYS[1], tonumber(ARGV[1]), nil)`,
  },
  /** Cancel: mark the request and claim the stop. Returns previous status or '' if unknown. */
  fleetCancel: {
    keys: 1,
    lua: `
      local status = redis.call('HGET', KEYS[1], 'status')
      if not status then return '' end
      -- Not once close began: it composes the result from what it read then, so a flag set now
      -- would only show on a close delivered again, ending a rollout this call was told it
      -- could not cancel as cancelled after all.
      if redis.call('HGET', KEYS[1], 'closed') ~= '1' then
        redis.call('HSET', KEYS[1], 'cancel', '1', 'fence', 'stopped')
      end
      return status`,
  },
  /**
   * A sandbox's destroy is confirmed: forget it (sandboxes hash, teardown ledger), and when it was
   * the rollout's last one on the ledger, mark its finalized result's teardown confirmed (see
   * `CONFIRM_TEARDOWN`), in the same step, so no closer or janitor can miss the edit. ARGV: the
   * sandbox's key, then the rollout's two sandbox keys, then its id. Returns 1 if the result was
   * edited.
   */
  fleetConfirm: {
    keys: 5, // sandboxes, teardown entries, teardown due, rollout, network retries
    // ARGV[5]: '' forgets the key whatever it holds; otherwise only an entry without a handle or,
    // unless ARGV[5] is '-', one whose handle is the sandbox destroyed (id ARGV[5]). An entry
    // recorded meanwhile for another sandbox under the same key (one that replaced the destroyed
    // one) is not this destroy's to forget.
    // ARGV[6], ARGV[7] (optional): a fence field of the rollout and the value it must hold, or
    // nothing is done (0): a seed delivery drops its intent only while it holds the seed fence.
    lua: `
      ${CONFIRM_TEARDOWN}
      ${FORGET_DESTROYED}
      if ARGV[6] and ARGV[6] ~= '' and redis.call('HGET', KEYS[4], ARGV[6]) ~= ARGV[7] then return 0 end
      forgetDestroyed(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[5])
      return confirmTeardown(KEYS[4], KEYS[2], ARGV[2], ARGV[3], KEYS[5], ARGV[4], KEYS[1])`,
  },
  /**
   * A rollout's gateway network removal, retried by the janitor, is done: forget the retry, and
   * when nothing else of the rollout is left on the ledger, mark its finalized result's teardown
   * confirmed (`CONFIRM_TEARDOWN`). ARGV: the rollout's id, then its two sandbox keys. Returns 1 if
   * the result was edited.
   */
  fleetNetworkRemoved: {
    keys: 4, // network retries, teardown entries, rollout, sandboxes
    lua: `
      ${CONFIRM_TEARDOWN}
      redis.call('ZREM', KEYS[1], ARGV[1])
      return confirmTeardown(KEYS[3], KEYS[2], ARGV[2], ARGV[3], KEYS[1], ARGV[1], KEYS[4])`,
  },
  /**
   * Begin a stage in one round trip. Unless the rollout is terminal: for close, set the tombstone
   * first; for the other stages, unless the stage will be skipped (closed, failed, cancelled, or
   * its receipt is stored), record the stage's first start time, and
   *  - with an intent key (seed), unless `now` is past the deadline: persist the sandbox intent
   *    (DESIGN §2 rule 9), kept if one exists; the entry is ARGV[6] .. (deadlineAt + ARGV[7]) ..
   *    '}' (its `expiresAt` closes it);
   *  - with a token (ARGV[8]): for run, the fenced launch claim of `fleetClaimLaunch` (rule 10);
   *    for verify, the verify fence (`vfence`: this attempt is the one that began last); for
   *    seed, the seed fence (`sfence`, likewise).
   * Returns [the values of `BEGIN_FIELDS` (for close `BEGIN_CLOSE_FIELDS`) in their order, nil
   * where absent, as they are after this call's writes; failure log, intent ('new' when this
   * call recorded it, 'ok' when an earlier attempt had, '' for none), previous fence (or
   * 'stopped'), launches, sandbox entries of ARGV[9], ARGV[10] ('' when absent or not asked),
   * ms an earlier verify attempt's sweep has left, when an earlier verify attempt last began
   * work in the sandbox (`t:verify:last`; nil for none or not verify), 1 if the attempt that
   * noted it has left the sandbox since (`fleetLeaveVerify`), else 0].
   * ARGV: stage, now, tombstone, withFailures, intentKey, intentPrefix, expirySlackMs,
   * token (run's launch, verify's fence), sandboxKey1, sandboxKey2 ('' for none), the run job's
   * BullMQ lock token ('' for none): a run's launch is claimed only while its job's lock (KEYS[4])
   * holds it, else 'superseded' (a begin that reached Redis after its delivery's lock lapsed).
   */
  fleetBegin: {
    keys: 4, // rollout, failures, sandboxes, the run job's BullMQ lock (else the rollout again)
    ...withPrelude(
      `
      ${TERMINAL}
      ${CLAIM_LAUNCH}
      ${RECORD_INTENT}
      ${BEGIN_SHAPES}`,
      `
      local stage, now, token = ARGV[1], ARGV[2], ARGV[8]
      local close = ARGV[3] == '1'
      -- Every field of the rollout this call checks or returns, read in one HMGET before it
      -- writes anything (a script runs alone: what it read holds until its own writes, which
      -- are applied to the values returned); its writes to the rollout go in one HSET.
      local shape = shapeOf(stage, close, ARGV[5] ~= '', token ~= '')
      local names, at, returned = shape.names, shape.at, shape.returned
      local iStart, iReceipt, iDeadline, iSeen = shape.iStart, shape.iReceipt, shape.iDeadline, shape.iSeen
      local iPrev, iLaunches, iLast, iSweep = shape.iPrev, shape.iLaunches, shape.iLast, shape.iSweep
      local iNote, iEpoch, iAware = shape.iNote, shape.iEpoch, shape.iAware
      if iSeen then names[iSeen] = shape.seen .. token elseif shape.iLseen then names[shape.iLseen] = 'lseen:' .. token end
      local v = redis.call('HMGET', KEYS[1], unpack(names))
      local status = v[at['status']]
      local writes = {}
      local function write(i, name, value)
        writes[#writes + 1] = name
        writes[#writes + 1] = value
        if i then v[i] = value end
      end
      local intent, previous, launches, prevTests, sweepLeft, prevLeft, epoch, prevAware = '', '', 0, false, 0, 0, 0, 0
      if status and not terminal[status] then
        if close then
          write(at['closed'], 'closed', '1')
          write(at['fence'], 'fence', 'stopped')
          if not v[iStart] then write(iStart, 't:' .. stage .. ':start', now) end
        else
          local skip = v[at['closed']] == '1'
            or v[at['failure']]
            or v[at['cancel']] == '1'
            or v[iReceipt]
          if not skip then
            if not v[iStart] then write(iStart, 't:' .. stage .. ':start', now) end
            if stage == 'verify' then
              -- When an earlier attempt last began work in the sandbox (a verify delivered again
              -- waits it out; see fleetNoteVerify).
              prevTests = v[iLast]
              -- Whether the attempt that noted it has left the sandbox (fleetLeaveVerify).
              -- Its mark names the note it left (an attempt of an older release notes without one).
              if v[iNote] and v[iLast] and v[iNote] == 'left:' .. v[iLast] then prevLeft = 1 end
              -- Whether that attempt honours the sandbox's verify fence (its release does).
              if v[iNote] and v[iLast] and v[iAware] == v[iNote] .. '@' .. v[iLast] then prevAware = 1 end
              -- How long an earlier attempt handed back at shutdown may still sweep its tests
              -- (every root process), by Redis's clock: this one starts nothing before that ends
              -- (fleetTestsSweep).
              local sweepUntil = tonumber(v[iSweep])
              if sweepUntil then
                local t = redis.call('TIME')
                sweepLeft = math.max(0, sweepUntil - (tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)))
              end
            end
            if iDeadline then
              -- Not past the deadline either: the stage would be skipped, and an intent left
              -- without a sandbox would hold the close's teardown for the intent grace period.
              -- The deadline is its own field (admission); meta is never decoded here (cjson
              -- refuses some JSON that JSON.parse accepts, e.g. lone surrogates in metadata).
              local deadline = tonumber(v[iDeadline])
              if deadline and tonumber(now) < deadline then
                local expires = string.format('%.0f', deadline + tonumber(ARGV[7]))
                -- 'new': no earlier attempt recorded it, so none can have created the sandbox.
                if recordIntent(KEYS[3], ARGV[5], ARGV[6] .. expires .. '}') == 1 then
                  intent = 'new'
                else
                  intent = 'ok'
                end
              end
            end
            if iSeen then
              -- The seed fence: only the delivery that began last may store the seed's receipt
              -- (fleetReceipt): an earlier one, its lock lapsed, must not store a sandbox the
              -- later one is replacing. The verify fence: only the attempt that began last may
              -- touch the sandbox, record a failure or store its receipt (fleetNoteVerify,
              -- fleetSetField, fleetReceipt). Each taken once per token: this very begin sent
              -- again by ioredis after a reconnect (a later delivery may have begun meanwhile)
              -- takes nothing back.
              -- A verify's token also gets its epoch (\`vepoch\`: one more than the attempt's
              -- before it), kept as its seen mark: in the sandbox, the tests' runner of an
              -- attempt with a lower one refuses to start once a later attempt raised the fence
              -- there (\`KillOptions.fenceEpoch\`).
              if not v[iSeen] then
                local prefix = stage == 'seed' and 's' or 'v'
                local seen = '1'
                if iEpoch then
                  epoch = (tonumber(v[iEpoch]) or 0) + 1
                  seen = tostring(epoch)
                  write(iEpoch, 'vepoch', seen)
                end
                write(iSeen, prefix .. 'seen:' .. token, seen)
                write(at[prefix .. 'fence'], prefix .. 'fence', token)
              elseif iEpoch then
                epoch = tonumber(v[iSeen]) or 0
              end
            elseif iLaunches then
              -- The fenced launch claim (fleetClaimLaunch's), on the values read above; none past
              -- the deadline: the run is skipped then, and a claim would count a launch that never was.
              local deadline = tonumber(v[shape.iRunDeadline])
              if not (deadline and tonumber(now) >= deadline) then
                -- Only while this delivery holds its job's lock: a begin held in its client's queue
                -- (an outage of its own link) past the lock reaches Redis after a later delivery's
                -- claim, or before it but too late to be the job's, and takes nothing from it.
                if ARGV[11] ~= '' and redis.call('GET', KEYS[4]) ~= ARGV[11] then
                  previous, launches = 'superseded', 0
                else
                  previous, launches = claimLaunch(KEYS[1], token, v[at['fence']], v[iPrev], v[iLaunches], v[at['closed']],
                    v[shape.iLseen], function(name, value) write(at[name], name, value) end)
                end
              end
            end
          end
        end
      end
      if #writes > 0 then redis.call('HSET', KEYS[1], unpack(writes)) end
      local failures = {}
      if ARGV[4] == '1' then failures = redis.call('LRANGE', KEYS[2], 0, -1) end
      local sb1, sb2 = '', ''
      if ARGV[9] ~= '' then sb1 = redis.call('HGET', KEYS[3], ARGV[9]) or '' end
      if ARGV[10] ~= '' then sb2 = redis.call('HGET', KEYS[3], ARGV[10]) or '' end
      local rec = {}
      for i = 1, returned do rec[i] = v[i] end
      return {rec, failures, intent, previous, launches, sb1, sb2, sweepLeft, prevTests, prevLeft, epoch, prevAware}`,
    ),
  },
  /**
   * Note that a verify attempt works in the sandbox from now (stages or starts its tests:
   * `t:verify:last`, and whose note it is: `vnote`, its token), or with an empty time clear that
   * note (its staging failed: nothing started), only while it is the attempt that began last
   * (`vfence` holds its token, ARGV[2]) and the rollout is not terminal; with ARGV[3] '1', the
   * attempt honours the sandbox's verify fence (`vaware`). ARGV: now ('' to clear),
   * token. Returns 1 if done, 0 if terminal (nothing to protect: its receipt will be refused), -1
   * if a later attempt began since: this one must not touch the sandbox.
   */
  fleetNoteVerify: {
    keys: 1,
    lua: `
      ${OPEN_OR_RETURN_0}
      if redis.call('HGET', KEYS[1], 'vfence') ~= ARGV[2] then return -1 end
      if ARGV[1] == '' then
        redis.call('HDEL', KEYS[1], 't:verify:last')
      elseif ARGV[3] == '1' then
        -- An attempt whose tests' runner and staging honour the sandbox's verify fence
        -- (\`vaware\`: its token and this note's time, so that a note of an older release
        -- since, which sets neither, is not taken for it): a later attempt may fence the
        -- sandbox against it.
        redis.call('HSET', KEYS[1], 't:verify:last', ARGV[1], 'vnote', ARGV[2], 'vaware', ARGV[2] .. '@' .. ARGV[1])
      else
        redis.call('HSET', KEYS[1], 't:verify:last', ARGV[1], 'vnote', ARGV[2])
      end
      return 1`,
  },
  /**
   * The sandbox's verify fence holds an epoch Redis never gave this rollout's attempts (its
   * `vepoch` lost in a failover, say): raise `vepoch` to at least ARGV[1], so that the next
   * attempt's is above the fence. Returns the epoch now.
   */
  fleetRaiseVerifyEpoch: {
    keys: 1,
    lua: `
      local e = tonumber(redis.call('HGET', KEYS[1], 'vepoch') or '0') or 0
      local want = tonumber(ARGV[1]) or 0
      if want > e and redis.call('EXISTS', KEYS[1]) == 1 then
        redis.call('HSET', KEYS[1], 'vepoch', tostring(want))
        e = want
      end
      return e`,
  },
  /**
   * A verify attempt that noted work in the sandbox (`fleetNoteVerify`) ends without handing its
   * verdict on (its exec broke, say): its code touches the sandbox no more, though its tests may
   * still run there. If the note is still its own (`vnote` holds its token, ARGV[1]), mark it
   * so (`left:` .. the note's time): a later attempt's begin returns it while `t:verify:last` is
   * still that note (one noted since, even by a release that sets no `vnote`, is not left), and
   * that attempt may stop those tests itself rather than wait out their budget. Returns 1 if
   * marked.
   */
  fleetLeaveVerify: {
    keys: 1,
    lua: `
      if redis.call('HGET', KEYS[1], 'vnote') ~= ARGV[1] then return 0 end
      redis.call('HSET', KEYS[1], 'vnote', 'left:' .. (redis.call('HGET', KEYS[1], 't:verify:last') or ''))
      return 1`,
  },
  /**
   * A verify attempt handed back at shutdown sweeps its tests (every root process in the
   * sandbox) only under a claim, taken while its token holds the verify fence and the rollout is
   * open, atomically with that check; a later attempt's begin (`fleetBegin`) returns how long the
   * claim has left, and that attempt starts nothing in the sandbox before it ends. Times are
   * Redis's (`TIME`): the workers' clocks may disagree.
   * - ARGV 'claim', windowMs, token: the claim's id (its end, ms, as a string), or 0 for a
   *   terminal rollout, -1 when a later attempt began (the tests there are not this one's).
   * - ARGV 'end', id, notedAt ('' for none): if the claim is still that one, deletes it and,
   *   with `notedAt` (the tests were confirmed stopped), the note of work in the sandbox if it is
   *   still that attempt's (`t:verify:last` equal to it), whoever holds the fence now: an attempt
   *   waiting on the claim has noted nothing yet. Returns 1 if it ended the claim.
   * - ARGV 'left': ms the claim has left (0: none).
   */
  fleetTestsSweep: {
    keys: 1,
    lua: `
      local t = redis.call('TIME')
      local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      if ARGV[1] == 'left' then
        local u = tonumber(redis.call('HGET', KEYS[1], 't:verify:sweep'))
        if not u then return 0 end
        return math.max(0, u - now)
      end
      if ARGV[1] == 'end' then
        if redis.call('HGET', KEYS[1], 't:verify:sweep') ~= ARGV[2] then return 0 end
        redis.call('HDEL', KEYS[1], 't:verify:sweep')
        if ARGV[3] ~= '' and redis.call('HGET', KEYS[1], 't:verify:last') == ARGV[3] then
          redis.call('HDEL', KEYS[1], 't:verify:last')
        end
        return 1
      end
      ${OPEN_OR_RETURN_0}
      if redis.call('HGET', KEYS[1], 'vfence') ~= ARGV[3] then return -1 end
      local id = string.format('%.0f', now + tonumber(ARGV[2]))
      redis.call('HSET', KEYS[1], 't:verify:sweep', id)
      return id`,
  },
  /**
   * Count one more close enqueued again for a rollout whose close ended without finalizing (by the
   * deadline watchdog or a stage worker). Returns the count, or 0 for a rollout unknown or terminal.
   * ARGV[1], when not '': the count its caller read before it found no close under way; another
   * count since (another janitor's pass, which enqueues that close) returns the count now,
   * negated, counting nothing. ARGV[2]: this call's id, kept with the count it made
   * (`closes:again:<id>`: a handful a rollout, as its callers count no further once past
   * CLOSE_AGAIN_LIMIT).
   */
  fleetNoteCloseAgain: {
    keys: 1,
    lua: `
      ${OPEN_OR_RETURN_0}
      local by = 'closes:again:' .. ARGV[2]
      local f = redis.call('HMGET', KEYS[1], 'closes:again', by)
      -- This very call again (ioredis re-sent it after a reconnect lost its reply): the count it
      -- made (kept under its id, whoever counted since), not a second one, nor that count taken
      -- for another caller's.
      if f[2] then return tonumber(f[2]) end
      local count = tonumber(f[1] or '0')
      if ARGV[1] ~= '' and count ~= tonumber(ARGV[1]) then return -count end
      count = redis.call('HINCRBY', KEYS[1], 'closes:again', 1)
      redis.call('HSET', KEYS[1], by, count)
      return count`,
  },
  /**
   * Claim (or renew) a bubblewrap fleet's sandbox host (`claimSandboxHost`): 1 when the key now
   * names ARGV[1] for ARGV[2] ms, else the host that holds it (nothing changed).
   */
  fleetHostClaim: {
    keys: 1,
    lua: `
      local cur = redis.call('GET', KEYS[1])
      if cur and cur ~= ARGV[1] then return cur end
      redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
      return 1`,
  },
  /**
   * Write a teardown ledger entry (a failed destroy, or an orphan scheduled) if the entry is still
   * what the caller read (ARGV[2]; '' for none): 1 if written. Otherwise nothing is written and the
   * entry now is returned (nil for none): another failure recorded meanwhile (the caller counts
   * again from it), or the destroy confirmed meanwhile (the entry gone).
   */
  fleetLedgerWrite: {
    keys: 2, // teardown entries, teardown due
    lua: `
      local cur = redis.call('HGET', KEYS[1], ARGV[1])
      if (cur or '') ~= ARGV[2] then return cur end
      redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
      redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
      return 1`,
  },
  /**
   * Put off a due ledger entry that does not parse (ARGV[1], its key) to ARGV[3], only while it
   * still holds the text read (ARGV[2]): a failure recorded over it since (due on its backoff) or
   * a confirm (nothing left to put off) is not the unreadable entry the put-off was for. Returns
   * 1 if put off.
   */
  fleetLedgerPutOff: {
    keys: 2, // teardown entries, teardown due
    lua: `
      if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
      return redis.call('ZADD', KEYS[2], 'XX', 'CH', ARGV[3], ARGV[1])`,
  },
  /**
   * Drop due marks (ARGV) whose ledger entry is gone: only our own scripts write or remove the
   * two together, so such a mark is one an operator or a restore left, due for good, taking a
   * slot of every pass's `due` read. Only those with no entry now (a forget and a new schedule of
   * the key since the read leave a pair). Returns the keys dropped.
   */
  fleetLedgerDropBare: {
    keys: 2, // teardown entries, teardown due
    lua: `
      local dropped = {}
      for _, key in ipairs(ARGV) do
        if redis.call('HEXISTS', KEYS[1], key) == 0 and redis.call('ZREM', KEYS[2], key) == 1 then
          dropped[#dropped + 1] = key
        end
      end
      return dropped`,
  },
  /**
   * Attach a created sandbox's handle to its intent; returns '1' if the rollout was closed
   * meanwhile. Finalized meanwhile (a close gave up on the handle-less intent while the create
   * still ran), its result's teardown is turned pending, as `fleetReceipt`'s attach does.
   */
  fleetAttach: {
    keys: 2, // sandboxes, rollout
    lua: `
      ${TERMINAL}
      ${CONFIRM_TEARDOWN}
      redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
      local v = redis.call('HMGET', KEYS[2], 'status', 'closed')
      if v[1] and terminal[v[1]] and not string.find(ARGV[2], '"handle":null', 1, true) then
        pendTeardown(KEYS[2], v[1])
      end
      return v[2] or ''`,
  },
} as const;

export type ScriptName = keyof typeof SCRIPTS;

/**
 * Scripts that also exist in a batched form, `<name>Many`, for `ScriptBatcher`: the same body
 * run once per item, each in its own `pcall` (an item's error is returned as
 * `{'__fleet_err', message}` in its slot; the others are unaffected). Called with the key count
 * first, then every item's keys, then every item's `args` arguments.
 */
export const BATCHED = {
  fleetBegin: { args: 11 },
  fleetReceipt: { args: 12 },
  fleetFinalize: { args: 14 },
} as const satisfies Partial<Record<ScriptName, { args: number }>>;
export type BatchedScript = keyof typeof BATCHED;

/**
 * The batched form of a script split by `withPrelude` (`keys` and `args` per item): its
 * prelude once, its body run for each item in a `pcall`, an item's error in its slot.
 */
export function batchedLua(def: { prelude: string; body: string; keys: number }, args: number): string {
  // `one` is declared on the prelude's last line: the body's lines, and so the line numbers in
  // its errors' messages, are where they were when the helpers were defined inside it.
  return `
    -- The helpers, once for all the items (upvalues of \`one\`).
      ${def.prelude} local function one(KEYS, ARGV)${def.body}
    end
    local nk, na = ${def.keys}, ${args}
    local out = {}
    for i = 0, #ARGV / na - 1 do
      local k, a = {}, {}
      for j = 1, nk do k[j] = KEYS[i * nk + j] end
      for j = 1, na do a[j] = ARGV[i * na + j] end
      local ok, r = pcall(one, k, a)
      if ok then out[i + 1] = r else out[i + 1] = {'${BATCH_ERROR}', tostring(r)} end
    end
    return out`;
}

type ScriptFn = (...args: (string | Buffer | number)[]) => Promise<unknown>;
export type ScriptedRedis = RedisConnection &
  Record<ScriptName, ScriptFn> &
  Record<`${BatchedScript}Many`, ScriptFn>;

/** Register the scripts on a connection (idempotent). */
export function withScripts(redis: RedisConnection): ScriptedRedis {
  const r = redis as ScriptedRedis;
  const has = (name: string) => typeof (r as unknown as Record<string, unknown>)[name] === "function";
  for (const [name, def] of Object.entries(SCRIPTS)) {
    // A script whose key count is null takes it first, from the caller (`fleetAdmit`).
    if (!has(name)) redis.defineCommand(name, { numberOfKeys: def.keys ?? undefined, lua: def.lua });
  }
  for (const name of Object.keys(BATCHED) as BatchedScript[]) {
    // No fixed key count: the caller passes it first.
    if (!has(`${name}Many`))
      redis.defineCommand(`${name}Many`, { lua: batchedLua(SCRIPTS[name], BATCHED[name].args) });
  }
  return r;
}
