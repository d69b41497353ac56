// A paged KV cache's addressing (SPEC "Paged KV cache"), shared by the decode kernels
// (ferro_decode.cuh) and the forward's paged builds (FERRO_PAGED: flash_fwd.cu,
// flash_fwd_wgmma.cu): key j of batch b lies in row j % page of block block_table[b, j / page],
// at element block * block_stride + row * row_stride from the KV head's column. Only keys that
// exist (j < kv_len) are translated, so a block a sequence does not reach is never read; a
// contiguous cache is one page holding every key (block 0, row j).
#pragma once
#include "ferro_params.cuh"

// FERRO_PAGED (configs.py's `paged`): a forward build that reads K and V through a block table.
// Dense only (a varlen call takes no block table), forward only (paged KV is inference).
#ifndef FERRO_PAGED
#define FERRO_PAGED 0
#endif
static_assert(!(FERRO_PAGED && FERRO_VARLEN),
              "a paged build is dense: configs.py never builds both");
// The forward kernels' block_table parameter, after cu_seqlens_k, in their paged builds alone
// (configs.py's Variant.args lists it there), so a plain build's parameters stay as they are.
#if FERRO_PAGED
#define FERRO_BLOCK_TABLE_PARAM const int* __restrict__ block_table,
#define FERRO_BLOCK_TABLE_ARG block_table
#else
#define FERRO_BLOCK_TABLE_PARAM
#define FERRO_BLOCK_TABLE_ARG nullptr
#endif

struct KeyPages {
    const int* pages;      // batch b's row of block_table (null: contiguous)
    u32 page, page_shift;  // rows per block; log2 of it when a power of two, else 32
};

// A contiguous cache: one page of every key.
__device__ __forceinline__ KeyPages contiguous_pages() {
    KeyPages pg;
    pg.pages = nullptr, pg.page = 0, pg.page_shift = 32;
    return pg;
}
// Batch b's pages of a paged call (block_table given, page_size >= 1). seq_k is the capacity:
// max_blocks * page_size.
__device__ __forceinline__ KeyPages key_pages(const int* block_table, u32 page_size, u32 seq_k,
                                              u32 b) {
    KeyPages pg;
    pg.page = page_size;
    pg.page_shift = (page_size & (page_size - 1)) ? 32u : (u32)(__ffs(page_size) - 1);
    pg.pages = block_table + (u64)b * (seq_k / page_size);
    return pg;
}

// Where key j (one that exists: j < kv_len) lies: its block (the table read) and row.
__device__ __forceinline__ void key_slot(const KeyPages& pg, long long j, u64& block, u64& row) {
    if (!pg.pages) {
        block = 0, row = (u64)j;
        return;
    }
    const u64 jj = (u64)j;
    const u64 t = pg.page_shift < 32 ? jj >> pg.page_shift : jj / pg.page;
    row = pg.page_shift < 32 ? jj & (pg.page - 1) : jj - t * pg.page;
    block = (u64)(u32)__ldg(pg.pages + t);
}

// The keys of one tile [jt, jt + n) (jt an existing key): translated once when one page holds
// them (a contiguous cache, or a page that holds the tile: consecutive rows of one block), else
// each key on its own (`at`).
struct TileSlots {
    bool one_page;
    long long jt;
    u64 block, row;  // jt's
    __device__ __forceinline__ TileSlots(const KeyPages& pg, long long jt_, long long n) : jt(jt_) {
        key_slot(pg, jt, block, row);
        one_page = !pg.pages || row + (u64)n <= pg.page;
    }
    __device__ __forceinline__ void at(const KeyPages& pg, long long j, u64& bl, u64& r) const {
        bl = block, r = row + (u64)(j - jt);
        if (!one_page) key_slot(pg, j, bl, r);
    }
};

// A tile copy's row addresses (ferro_copy.cuh's RowAt) through the pages: key j's row at
// block * block_stride + row * row_stride elements from the KV head's column. A copy asks only
// for keys below its n_rows, so a tile built for keys [jt, min(jt + rows, n_rows)) translates
// nothing past them.
struct PagedRows {
    KeyPages pg;
    TileSlots tile;
    u64 block_stride, row_stride;
    __device__ __forceinline__ PagedRows(const KeyPages& pg_, const Strides& t, long long jt,
                                         long long rows, long long n_rows)
        : pg(pg_), tile(pg_, jt, min(rows, n_rows - jt)), block_stride(t.b), row_stride(t.s) {}
    // The same keys' rows in a tensor of strides t (V's beside K's: one translation for both).
    __device__ __forceinline__ PagedRows with_strides(const Strides& t) const {
        PagedRows r = *this;
        r.block_stride = t.b, r.row_stride = t.s;
        return r;
    }
    __device__ __forceinline__ u64 operator()(long long j) const {
        u64 bl, r;
        tile.at(pg, j, bl, r);
        return bl * block_stride + r * row_stride;
    }
};
