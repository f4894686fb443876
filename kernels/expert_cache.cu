// expert_cache.cu: the device side of the expert slot cache (docs/design.md, The cache rules and The kernel contract).
//
// Two kernels run per MoE layer per forward, on the caller's stream, with no host sync:
//
//   expert_cache_manage_kernel  one block of EC_THREADS threads. Marks the step's distinct
//       routed experts, refreshes the resident ones, lists the misses in ascending expert
//       order, picks victims among the slots this step does not need by the key
//       (occupied, prio, slot), installs, writes the remapped (slot-space) routing ids and
//       bumps two int64 counters. Integer block scans (shuffles within a warp of
//       ec_compat.h's width, shared memory between warps) and plain stores: no atomics,
//       so every rank that sees the same routing evolves the same state bit for bit (the
//       tensor-parallel contract). A step with nothing to install skips the victim search
//       and its barriers. For vLLM's Marlin experts, which keep the routing in expert
//       space and build their block list from it, the same launch rewrites that list in
//       place instead, each block's expert id replaced by its slot (an id outside 0..E-1,
//       vLLM's filler, is clamped into it; an expert not resident reads slot 0: only
//       padding rows route there and their output is dropped): the layer then launches
//       no more kernels than on Triton's experts.
//   expert_cache_gather_kernel  a fixed grid that copies every (expert, slot) of the miss
//       list from host memory (UVA) into the slot buffers of up to EC_GATHER_MAX_TENSORS
//       per-expert tensors, 16 bytes a lane. The miss count is read on the device, so the
//       launch is the same whatever the misses are: CUDA-graph capturable. Blocks with no
//       work return at once, which is what makes an all-hit step cheap. One tensor of the
//       launch may also be spread (ABI 6): every 4-byte word of its slab is written, as
//       well, into compact per-expert arrays. That is the plugin's packed side row of
//       small per-expert tensors (NVFP4's float32 global scales): the compact [S, ...]
//       copies vLLM's kernel reads are filled by the same stores that install the row,
//       instead of by a copy per run after every step (one graph node a layer fewer, and
//       an all-hit step moves nothing for them at all).
//
// The file is compiled two ways: by NVRTC at first use (kernels only: the host wrappers
// are kept out by EC_KERNELS_ONLY) and by nvcc into a shared library whose C entry points
// expert_cache_manage / expert_cache_gather validate their
// arguments, return a nonzero EC_ERR_* code instead of launching when something is wrong,
// and otherwise return the launch error code. expertcache_cli/device/binding.py is the one
// Python module that mirrors this ABI; change both together and bump EC_ABI_VERSION.
#include "ec_compat.h"

#define EC_ABI_VERSION 6
#define EC_THREADS 256              // manager block size; the gather uses the same
#define EC_MAX_EXPERTS 16384        // bounded by the manager's shared memory (one byte each)
#define EC_MAX_SLOTS 1024           // bounded by the manager's shared memory (24 bytes each)
#define EC_GATHER_MAX_TENSORS 16    // per launch (act-order GPTQ has 10); wider calls are split
#define EC_GATHER_UNROLL 4          // independent 16-byte loads in flight per lane
#define EC_SPREAD_MAX 8             // compact targets of the spread tensor (a side row of
                                    // up to 8 small tensors; more: the plugin copies them)
#define EC_TAB_REGS 4               // table entries per manager thread held in registers
static_assert(EC_THREADS % EC_WARP == 0, "the manager's scan takes whole warps");

#define EC_POLICY_LRU 0             // = expertcache_cli.rules.policy.Policy.LRU
#define EC_POLICY_LFU 1             // = expertcache_cli.rules.policy.Policy.LFU

// Validation failures of the host wrappers (CUDA error codes are all below 1000).
#define EC_ERR_SIZE 1001            // num_experts / num_slots / n_ids / grid out of range
#define EC_ERR_POLICY 1002          // policy code is not LRU or LFU, or decay < 0
#define EC_ERR_NULL 1003            // a required pointer is null
#define EC_ERR_ALIGN 1004           // a gather pointer is not 16-byte aligned
#define EC_ERR_SLAB 1005            // a per-expert slab is not a positive multiple of 16 bytes
#define EC_ERR_SPREAD 1006          // bad spread: tensor index, target count, a target not
                                    // 4-byte aligned or not inside the spread tensor's slab

#define EC_KEY_NONE 0x7fffffffffffffffLL   // key of a slot that is not evictable this step
#define EC_KEY_OCCUPIED (1LL << 62)        // occupied slots rank after every empty one

// Dynamic shared memory of the manager, in bytes (binding.py computes the same).
#define EC_MANAGE_SMEM(E, S) \
    ((((long long)(S) * 24 + EC_THREADS / EC_WARP * 4 + (long long)(E)) + 15) / 16 * 16)

// Kernel argument of the gather, passed by value (binding.py mirrors it with ctypes).
struct EcGatherParams {
    const ec_vec16* src[EC_GATHER_MAX_TENSORS];  // [E, slab] per tensor, host (UVA) or device
    ec_vec16* dst[EC_GATHER_MAX_TENSORS];        // [S, slab] per tensor, device
    long long vecs[EC_GATHER_MAX_TENSORS];       // slab of one expert, in 16-byte units
    long long per_miss;                          // sum of vecs: 16-byte units per miss
    int n_tensors;
    int spread_tensor;                           // index in this launch, -1 for none
    // The spread: word w of the spread tensor's slab (4-byte units; w = 4 * vector + lane
    // word) with spread_off[i] <= w < spread_off[i] + spread_words[i] is also stored at
    // spread_dst[i][slot * spread_words[i] + w - spread_off[i]] (by every target that
    // covers it); words past every target (the row's padding) go nowhere.
    unsigned int* spread_dst[EC_SPREAD_MAX];     // [S, spread_words[i]] each, device
    int spread_off[EC_SPREAD_MAX];               // first word of the target in the slab
    int spread_words[EC_SPREAD_MAX];             // words of the target an expert
    int n_spread;                                // targets in use (0 with spread_tensor -1)
    int reserved;
};
static_assert(sizeof(EcGatherParams) == 536, "binding.GatherParams mirrors this layout");

__device__ __forceinline__ long long ec_load_id(const void* ids, int i, int ids_is64) {
    return ids_is64 ? ((const long long*)ids)[i] : (long long)((const int*)ids)[i];
}

__device__ __forceinline__ void ec_store_id(void* ids, int i, int ids_is64, long long v) {
    if (ids_is64)
        ((long long*)ids)[i] = v;
    else
        ((int*)ids)[i] = (int)v;
}

// A padding row's id: past the real rows' count, or in a row the runner marked.
__device__ __forceinline__ bool ec_pad_row(int i, int n_real, const unsigned char* pad_rows,
                                           int row_width) {
    return i >= n_real || (pad_rows != nullptr && pad_rows[i / row_width] != 0);
}

// Step 3 for one expert of R: refresh its slot, or append it to the miss list.
__device__ __forceinline__ void ec_refresh_or_list(int e, int slot, int policy, long long now,
                                                   long long* s_prio, int* s_miss, int wanted,
                                                   int& rank) {
    if (slot >= 0) {
        if (policy == EC_POLICY_LRU)
            s_prio[slot] = now;
        else
            s_prio[slot] += 1;
    } else {
        if (rank < wanted) s_miss[rank] = e;
        ++rank;
    }
}

extern "C" __global__ void __launch_bounds__(EC_THREADS) expert_cache_manage_kernel(
    const void* __restrict__ ids,   // [n_ids] routing ids (int32 or int64), <0 or >=E = padding
    int n_ids, int ids_is64,
    int* __restrict__ table,        // [E] expert -> slot or -1
    int* __restrict__ slot_expert,  // [S] slot -> expert or -1
    long long* __restrict__ prio,   // [S]
    long long* __restrict__ step,   // [1]
    int* __restrict__ miss_expert,  // [S] out: installed experts, ascending
    int* __restrict__ miss_slot,    // [S] out: their slots
    int* __restrict__ miss_count,   // [1] out: installs this step
    void* __restrict__ out_ids,     // [n_ids] out (same dtype as ids): slot-space ids, or null
    long long* __restrict__ stats,  // [2] accumulated: distinct ids seen, installs; or null
    const int* __restrict__ real_rows,  // [1] rows of ids that are real, or null (all are):
                                        // ids of later rows (CUDA-graph padding) are not
                                        // requested and remap to slot 0 (vLLM's V1 runner)
    const unsigned char* __restrict__ pad_rows,  // [rows] nonzero = a padding row, or null
                                        // (vLLM's V2 runner marks them): the same
    int row_width,                      // ids per row (top_k), for real_rows / pad_rows
    int* __restrict__ blocks,           // [n_blocks] vLLM Marlin's block list (expert ids),
    int n_blocks,                       // rewritten in place to slots; or null / 0
    int num_experts, int num_slots, int policy, int decay, int max_distinct, int max_inserts) {
    extern __shared__ __align__(16) unsigned char ec_smem[];
    const int E = num_experts;
    const int S = num_slots;
    const int tid = threadIdx.x;
    long long* s_prio = (long long*)ec_smem;         // [S] working copy of prio
    long long* s_key = s_prio + S;                   // [S] victim key, EC_KEY_NONE if pinned
    int* s_sexp = (int*)(s_key + S);                 // [S] working copy of slot_expert
    int* s_miss = s_sexp + S;                        // [S] missed experts, ascending
    int* s_scan = s_miss + S;                        // [EC_THREADS / EC_WARP] warp totals
    unsigned char* s_mark = (unsigned char*)(s_scan + EC_THREADS / EC_WARP);  // [E] in R
    __shared__ long long s_step;

    // Each thread owns a contiguous chunk of expert ids (ascending order falls out of a
    // scan over chunks). The first EC_TAB_REGS table entries of the chunk are loaded into
    // registers up front, with the state and the thread's first routing id, so that the
    // global-memory latencies overlap instead of following one another.
    const int chunk = (E + EC_THREADS - 1) / EC_THREADS;
    const int lo = min(tid * chunk, E);
    const int hi = min(lo + chunk, E);

    // Launched with PDL (binding.py), this kernel may begin while the one before it (the
    // router, which writes ids) finishes: warm L2 with this layer's state meanwhile (cold
    // in serving: a whole decode step of other layers ran since this layer's last call),
    // then wait for it, and let the gather behind this launch start (it waits for this
    // kernel in turn). Without PDL the three are no-ops or harmless hints.
    for (int e = tid * 32; e < E; e += EC_THREADS * 32) ec_prefetch_l2(table + e);
    for (int s = tid * 32; s < S; s += EC_THREADS * 32) ec_prefetch_l2(slot_expert + s);
    for (int s = tid * 16; s < S; s += EC_THREADS * 16) ec_prefetch_l2(prio + s);
    if (tid == 0) {
        ec_prefetch_l2(step);
        if (stats != nullptr) ec_prefetch_l2(stats);
    }
    ec_grid_wait();
    ec_grid_release_dependents();

    // Ids at or past n_real, or in a row pad_rows marks, belong to padding rows: read as
    // padding by the mark, written as slot 0 by the remap (any valid slot: the caller
    // discards those rows' output). Read on the device, so a captured graph takes each
    // replay's own count and marks.
    // (this thread's id is loaded before the count arrives, not after: two loads in
    // flight at once instead of one behind the other)
    const long long raw_id = (tid < n_ids) ? ec_load_id(ids, tid, ids_is64) : -1;
    int n_real = n_ids;
    if (real_rows != nullptr) {
        const long long r = (long long)max(real_rows[0], 0) * (long long)row_width;
        n_real = (int)min(r, (long long)n_ids);
    }

    // 0. Load the slot state, clear the marks, advance the step.
    int tab_reg[EC_TAB_REGS];
#pragma unroll
    for (int u = 0; u < EC_TAB_REGS; ++u) tab_reg[u] = (lo + u < hi) ? ec_ld(table + lo + u) : -1;
    const bool my_pad = tid < n_ids && ec_pad_row(tid, n_real, pad_rows, row_width);
    const long long my_id = my_pad ? -1 : raw_id;
    // the slot of this thread's id, read now so that its latency hides behind the barriers
    // below: the remap takes it when the step installs nothing (the table is then final)
    const int my_slot_now = (my_id >= 0 && my_id < E) ? ec_ld(table + my_id) : -1;
    // The slot state and the step are loaded into registers now and stored to shared
    // memory only before the scan's barrier (which waits for the table anyway): served,
    // they come from DRAM, and the two barriers before that need none of them.
    // (one slot a thread: more than EC_THREADS slots are rare, and the rest are read where
    // they are stored)
    const long long prio_reg = (tid < S) ? ec_ld(prio + tid) : 0;
    const int sexp_reg = (tid < S) ? ec_ld(slot_expert + tid) : -1;
    for (int e = tid; e < E; e += EC_THREADS) s_mark[e] = 0;
    // thread 0 also reads the counters now, with the rest of the state, rather than at the
    // end, where a cold read (served, a whole decode step ran since) would be the last
    // thing the kernel waits for
    long long seen_before = 0, installs_before = 0, step_before = 0;
    if (tid == 0) {
        step_before = ec_ld(step);
        if (stats != nullptr) {
            seen_before = ec_ld(stats);
            installs_before = ec_ld(stats + 1);
        }
    }
    __syncthreads();

    // 1. Mark the distinct valid ids. Threads that hit the same expert store the same
    //    byte, so the result does not depend on their order.
    if (my_id >= 0 && my_id < E) s_mark[my_id] = 1;
    for (int i = tid + EC_THREADS; i < n_real; i += EC_THREADS) {
        if (ec_pad_row(i, n_real, pad_rows, row_width)) continue;
        const long long e = ec_load_id(ids, i, ids_is64);
        if (e >= 0 && e < E) s_mark[e] = 1;
    }
    __syncthreads();

    // 2. An exclusive scan of the per-chunk counts gives every miss its rank in ascending
    //    expert order. Counts of R and of misses are packed in one int (both < 65536
    //    because E <= EC_MAX_EXPERTS).
    int mine = 0;
#pragma unroll
    for (int u = 0; u < EC_TAB_REGS; ++u)
        if (lo + u < hi && s_mark[lo + u]) mine += (tab_reg[u] < 0) ? 0x10001 : 0x10000;
    for (int e = lo + EC_TAB_REGS; e < hi; ++e)
        if (s_mark[e]) mine += (ec_ld(table + e) < 0) ? 0x10001 : 0x10000;
    if (tid < S) {
        s_prio[tid] = prio_reg;
        s_sexp[tid] = sexp_reg;
    }
    for (int s = tid + EC_THREADS; s < S; s += EC_THREADS) {
        s_prio[s] = ec_ld(prio + s);
        s_sexp[s] = ec_ld(slot_expert + s);
    }
    if (tid == 0) s_step = step_before + 1;
    // Inclusive scan within each warp by shuffles, then every thread adds the totals of the
    // warps before its own from shared memory: one block barrier in all (it also publishes
    // the slot state and the step stored just above).
    const int lane = tid % EC_WARP;
    const int warp = tid / EC_WARP;
    int incl = mine;
#pragma unroll
    for (int d = 1; d < EC_WARP; d <<= 1) {
        const int y = ec_shfl_up(incl, d);
        if (lane >= d) incl += y;
    }
    if (lane == EC_WARP - 1) s_scan[warp] = incl;
    __syncthreads();
    int base = 0, total = 0;
#pragma unroll
    for (int w = 0; w < EC_THREADS / EC_WARP; ++w) {
        const int t = s_scan[w];
        base += (w < warp) ? t : 0;
        total += t;
    }
    const int before = base + incl - mine;  // exclusive prefix
    const int n_distinct = total >> 16;
    const int n_missing = total & 0xffff;
    const long long now = s_step;
    int installs = 0;

    if (n_distinct <= max_distinct) {  // else: read-through step, nothing else changes
        const int wanted = min(n_missing, max_inserts);
        // Slots this step does not need are evictable; each resident expert of R pins
        // exactly one slot, so their number is known without another reduction.
        const int evictable = S - (n_distinct - n_missing);
        installs = min(wanted, evictable);
        const bool decay_now = policy == EC_POLICY_LFU && decay > 0 && now % decay == 0;
        if (installs == 0 && !decay_now) {
            // 3'. Nothing to install (every routed expert resident, the usual decode step):
            //     the refreshes go straight to prio; no victim search, no more barriers.
#pragma unroll
            for (int u = 0; u < EC_TAB_REGS; ++u)
                if (lo + u < hi && s_mark[lo + u] && tab_reg[u] >= 0)
                    ec_st(prio + tab_reg[u],
                          (policy == EC_POLICY_LRU) ? now : s_prio[tab_reg[u]] + 1);
            for (int e = lo + EC_TAB_REGS; e < hi; ++e) {
                const int slot = s_mark[e] ? ec_ld(table + e) : -1;
                if (slot >= 0)
                    ec_st(prio + slot, (policy == EC_POLICY_LRU) ? now : s_prio[slot] + 1);
            }
        } else {
            // 3. Refresh resident experts of R (each owns a distinct slot: no conflicts) and
            //    list the first `wanted` misses in ascending expert order.
            int rank = before & 0xffff;
#pragma unroll
            for (int u = 0; u < EC_TAB_REGS; ++u)
                if (lo + u < hi && s_mark[lo + u])
                    ec_refresh_or_list(lo + u, tab_reg[u], policy, now, s_prio, s_miss, wanted,
                                       rank);
            for (int e = lo + EC_TAB_REGS; e < hi; ++e)
                if (s_mark[e])
                    ec_refresh_or_list(e, ec_ld(table + e), policy, now, s_prio, s_miss, wanted,
                                       rank);
            __syncthreads();
            // 4. LFU decay, after the refreshes, over every slot (empty ones included).
            if (decay_now) {
                for (int s = tid; s < S; s += EC_THREADS) s_prio[s] >>= 1;
                __syncthreads();
            }
            // 5. Victims among the evictable slots, one for each of the `installs` misses.
            if (installs > 0) {
                // Victim key (occupied, prio, slot) packed in one int64 so that ranking is a
                // single compare: occupied at bit 62, prio in bits 10..61 (prio <= step, and
                // 2^52 steps never happen), slot in bits 0..9 (S <= EC_MAX_SLOTS = 1024).
                // Keys are unique; slots this step needs get EC_KEY_NONE (ranked last).
                for (int s = tid; s < S; s += EC_THREADS) {
                    const int x = s_sexp[s];
                    s_key[s] = (x >= 0 && s_mark[x])
                                   ? EC_KEY_NONE
                                   : ((x >= 0 ? EC_KEY_OCCUPIED : 0LL) | (s_prio[s] << 10) | s);
                }
                __syncthreads();
                // The k-th smallest key is the victim of the k-th miss. Rank by counting
                // smaller keys, 8 at a time; stop as soon as the slot cannot be a victim.
                for (int s = tid; s < S; s += EC_THREADS) {
                    const long long k = s_key[s];
                    if (k == EC_KEY_NONE) continue;
                    int r = 0;
                    for (int j0 = 0; j0 < S && r < installs; j0 += 8) {
#pragma unroll
                        for (int u = 0; u < 8; ++u) {
                            const int j = j0 + u;
                            if (j < S) r += (s_key[j] < k) ? 1 : 0;
                        }
                    }
                    if (r >= installs) continue;
                    // 6. Install miss r in slot s (distinct experts and slots per thread).
                    const int e = s_miss[r];
                    const int old = s_sexp[s];
                    if (old >= 0) ec_st(table + old, -1);
                    ec_st(table + e, s);
                    ec_st(slot_expert + s, e);
                    s_prio[s] = (policy == EC_POLICY_LRU) ? now : 1LL;
                    miss_expert[r] = e;
                    miss_slot[r] = s;
                }
            }
            __syncthreads();  // table and s_prio final for the whole block
            for (int s = tid; s < S; s += EC_THREADS) ec_st(prio + s, s_prio[s]);
        }
    }

    // 7. Remap the routing ids to slot space through the updated table (fused, so the
    //    layer needs no separate remap launch). Padding ids pass through unchanged; the
    //    ids of padding rows (past n_real, or marked) become slot 0.
    if (out_ids != nullptr) {
        if (tid < n_ids)
            ec_store_id(out_ids, tid, ids_is64,
                        my_pad ? 0LL
                        : (my_id < 0 || my_id >= E) ? my_id
                        : (long long)(installs == 0 ? my_slot_now : ec_ld(table + my_id)));
        for (int i = tid + EC_THREADS; i < n_ids; i += EC_THREADS) {
            if (ec_pad_row(i, n_real, pad_rows, row_width)) {
                ec_store_id(out_ids, i, ids_is64, 0LL);
                continue;
            }
            const long long e = ec_load_id(ids, i, ids_is64);
            ec_store_id(out_ids, i, ids_is64, (e >= 0 && e < E) ? (long long)ec_ld(table + e) : e);
        }
    }
    // 8. The block list of vLLM's Marlin experts, built over expert ids, rewritten to the
    //    slots through the same table (final here: written by this block before the last
    //    barrier, or not written at all this step).
    for (int i = tid; i < n_blocks; i += EC_THREADS) {
        int e = blocks[i];
        e = e < 0 ? 0 : (e >= E ? E - 1 : e);
        const int slot = ec_ld(table + e);
        blocks[i] = slot < 0 ? 0 : slot;
    }
    if (tid == 0) {
        ec_st(step, now);
        miss_count[0] = installs;
        if (stats != nullptr) {
            ec_st(stats, seen_before + n_distinct);
            ec_st(stats + 1, installs_before + installs);
        }
    }
}

// The spread of one gathered vector (EcGatherParams): its four words into the compact
// targets they belong to; ``d`` is where the vector went in the spread tensor's slot
// buffer, which gives its slot and its place in the slab. Off the hot path: only the
// spread tensor's vectors come here (one a miss for NVFP4's 16-byte row), so that
// buffer and its vector count are picked by a static walk rather than kept in registers
// by every lane (a dynamic index into the kernel parameters could make the compiler copy
// them to local memory).
__device__ __forceinline__ void ec_spread(const EcGatherParams& p, const ec_vec16* d,
                                          ec_vec16 v) {
    const ec_vec16* base = p.dst[0];
    long long n = p.vecs[0];
#pragma unroll
    for (int t = 1; t < EC_GATHER_MAX_TENSORS; ++t) {
        if (t == p.spread_tensor) {
            base = p.dst[t];
            n = p.vecs[t];
        }
    }
    const long long q = d - base;  // slot * n + vector
    const long long slot = q / n;
    const int w0 = (int)(q - slot * n) * 4;  // the vector's first word in the slab
    const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < EC_SPREAD_MAX; ++i) {
        if (i >= p.n_spread) break;
        const int off = p.spread_off[i], words = p.spread_words[i];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int k = w0 + j - off;
            if (k >= 0 && k < words) p.spread_dst[i][slot * words + k] = w[j];
        }
    }
}

extern "C" __global__ void __launch_bounds__(EC_THREADS) expert_cache_gather_kernel(
    const int* __restrict__ miss_expert, const int* __restrict__ miss_slot,
    const int* __restrict__ miss_count, EcGatherParams p) {
    ec_grid_wait();  // PDL: launched early behind the manager; its miss list is read below
    const long long total = (long long)miss_count[0] * p.per_miss;  // 16-byte units
    long long idx = (long long)blockIdx.x * EC_THREADS + threadIdx.x;
    if ((long long)blockIdx.x * EC_THREADS >= total) return;  // no work: leave at once
    const long long stride = (long long)gridDim.x * EC_THREADS;
    for (; idx < total; idx += stride * EC_GATHER_UNROLL) {
        ec_vec16 v[EC_GATHER_UNROLL];
        ec_vec16* d[EC_GATHER_UNROLL];
        // bit u: load u is of the spread tensor (one register, not a slot and an offset
        // kept per load: the spread recovers both from the destination, off the hot path)
        unsigned spread = 0;
#pragma unroll
        for (int u = 0; u < EC_GATHER_UNROLL; ++u) {
            const long long i = idx + u * stride;
            d[u] = nullptr;
            if (i < total) {
                const long long k = i / p.per_miss;
                long long r = i - k * p.per_miss;
                const ec_vec16* sp = p.src[0];
                ec_vec16* dp = p.dst[0];
                long long n = p.vecs[0];
                int tensor = 0;
#pragma unroll
                for (int t = 1; t < EC_GATHER_MAX_TENSORS; ++t) {
                    if (r >= n) {  // past this tensor's slab: move to the next one
                        r -= n;
                        sp = p.src[t];
                        dp = p.dst[t];
                        n = p.vecs[t];
                        tensor = t;
                    }
                }
                v[u] = sp[(long long)miss_expert[k] * n + r];
                d[u] = dp + (long long)miss_slot[k] * n + r;
                if (tensor == p.spread_tensor) spread |= 1u << u;
            }
        }
#pragma unroll
        for (int u = 0; u < EC_GATHER_UNROLL; ++u) {
            if (d[u] != nullptr) *d[u] = v[u];
            // the packed slot row gets its vector as ever (the audit reads it); the spread
            // adds the compact copies
            if (spread & (1u << u)) ec_spread(p, d[u], v[u]);
        }
    }
}

#ifndef EC_KERNELS_ONLY
// ---------------------------------------------------------------------------------------
// Host entry points of the shared library (C linkage; bound by name through ctypes).

extern "C" int expert_cache_abi_version(void) { return EC_ABI_VERSION; }

// Programmatic dependent launch for every later launch of this process (0 = off until
// the binding decides: binding.py turns it on on sm_90+ with a 12.3+ driver unless
// EXPERT_CACHE_PDL=0). Returns the previous setting.
static int ec_pdl = 0;
extern "C" int expert_cache_set_pdl(int on) {
    const int old = ec_pdl;
    ec_pdl = on != 0;
    return old;
}

extern "C" long long expert_cache_manage_smem(int num_experts, int num_slots) {
    return EC_MANAGE_SMEM(num_experts, num_slots);
}

extern "C" int expert_cache_manage(const void* ids, int n_ids, int ids_is64, int* table,
                                   int* slot_expert, long long* prio, long long* step,
                                   int* miss_expert, int* miss_slot, int* miss_count,
                                   void* out_ids, long long* stats, const int* real_rows,
                                   const unsigned char* pad_rows, int row_width,
                                   int* blocks, int n_blocks, int num_experts,
                                   int num_slots, int policy, int decay, int max_distinct,
                                   int max_inserts,
                                   void* stream) {
    if (num_experts < 1 || num_experts > EC_MAX_EXPERTS || num_slots < 1 ||
        num_slots > EC_MAX_SLOTS || n_ids < 0 || max_distinct < 0 || max_inserts < 0)
        return EC_ERR_SIZE;
    if ((policy != EC_POLICY_LRU && policy != EC_POLICY_LFU) || decay < 0) return EC_ERR_POLICY;
    if ((n_ids > 0 && ids == nullptr) || !table || !slot_expert || !prio || !step ||
        !miss_expert || !miss_slot || !miss_count)
        return EC_ERR_NULL;
    if (ids_is64 != 0 && ids_is64 != 1) return EC_ERR_SIZE;
    if ((real_rows != nullptr || pad_rows != nullptr) && row_width < 1) return EC_ERR_SIZE;
    if (n_blocks < 0) return EC_ERR_SIZE;
    if (n_blocks > 0 && blocks == nullptr) return EC_ERR_NULL;
    (void)ec_get_last_error();  // report this launch's error, not an older one
    EC_LAUNCH_PDL(ec_pdl, expert_cache_manage_kernel, 1, EC_THREADS,
                  (size_t)EC_MANAGE_SMEM(num_experts, num_slots), (ec_stream_t)stream, ids,
                  n_ids, ids_is64, table, slot_expert, prio, step, miss_expert, miss_slot,
                  miss_count, out_ids, stats, real_rows, pad_rows, row_width, blocks, n_blocks,
                  num_experts, num_slots, policy, decay, max_distinct, max_inserts);
    return ec_get_last_error();
}

// spread_tensor: the index (over all n_tensors) of the tensor whose slab is also spread
// into n_spread compact targets (EcGatherParams: spread_dsts[i], spread_off[i] and
// spread_words[i] in 4-byte words), or -1 with n_spread 0 for none; it reaches the one
// launch that holds that tensor.
extern "C" int expert_cache_gather(const int* miss_expert, const int* miss_slot,
                                   const int* miss_count, int n_tensors,
                                   const void* const* srcs, void* const* dsts,
                                   const long long* slab_bytes, int spread_tensor,
                                   int n_spread, void* const* spread_dsts,
                                   const int* spread_off, const int* spread_words, int grid,
                                   void* stream) {
    if (n_tensors < 1 || grid < 1) return EC_ERR_SIZE;
    if (!miss_expert || !miss_slot || !miss_count || !srcs || !dsts || !slab_bytes)
        return EC_ERR_NULL;
    for (int t = 0; t < n_tensors; ++t) {
        if (!srcs[t] || !dsts[t]) return EC_ERR_NULL;
        if (slab_bytes[t] <= 0 || slab_bytes[t] % 16 != 0) return EC_ERR_SLAB;
        if (((unsigned long long)srcs[t] | (unsigned long long)dsts[t]) % 16 != 0)
            return EC_ERR_ALIGN;
    }
    if (spread_tensor < -1 || spread_tensor >= n_tensors) return EC_ERR_SPREAD;
    if (spread_tensor == -1 ? n_spread != 0 : (n_spread < 1 || n_spread > EC_SPREAD_MAX))
        return EC_ERR_SPREAD;
    if (n_spread > 0 && (!spread_dsts || !spread_off || !spread_words)) return EC_ERR_NULL;
    for (int i = 0; i < n_spread; ++i) {
        if (!spread_dsts[i]) return EC_ERR_NULL;
        // a target is whole words of the slab (the kernel stores 4-byte words), past none
        if ((unsigned long long)spread_dsts[i] % 4 != 0 || spread_off[i] < 0 ||
            spread_words[i] < 1 ||
            (long long)spread_off[i] + spread_words[i] > slab_bytes[spread_tensor] / 4)
            return EC_ERR_SPREAD;
    }
    (void)ec_get_last_error();
    for (int first = 0; first < n_tensors; first += EC_GATHER_MAX_TENSORS) {
        EcGatherParams p = {};
        const int left = n_tensors - first;
        const int n = left < EC_GATHER_MAX_TENSORS ? left : EC_GATHER_MAX_TENSORS;
        for (int t = 0; t < n; ++t) {
            p.src[t] = (const ec_vec16*)srcs[first + t];
            p.dst[t] = (ec_vec16*)dsts[first + t];
            p.vecs[t] = slab_bytes[first + t] / 16;
            p.per_miss += p.vecs[t];
        }
        p.n_tensors = n;
        p.spread_tensor = -1;
        if (spread_tensor >= first && spread_tensor < first + n) {
            p.spread_tensor = spread_tensor - first;
            p.n_spread = n_spread;
            for (int i = 0; i < n_spread; ++i) {
                p.spread_dst[i] = (unsigned int*)spread_dsts[i];
                p.spread_off[i] = spread_off[i];
                p.spread_words[i] = spread_words[i];
            }
        }
        EC_LAUNCH_PDL(ec_pdl, expert_cache_gather_kernel, grid, EC_THREADS, 0,
                      (ec_stream_t)stream, miss_expert, miss_slot, miss_count, p);
        const int err = ec_get_last_error();
        if (err != 0) return err;
    }
    return 0;
}
#endif  // EC_KERNELS_ONLY
