/* The prompt-lookup index's hash tables (helexa/engine/speculative/ngram.py owns them and their memory).

   One table per n-gram length n, open addressing with linear probing over a power-of-two number of
   slots. A slot holds an int32 position p (-1: empty) and stands for the n-gram tokens[p-n .. p-1]: the
   latest indexed occurrence of that n-gram was followed by the token at p. The key itself is never
   stored; it is read from the token list, so a slot costs 4 bytes and equal keys are found by comparing
   tokens (no hash collision can ever return another n-gram). The caller keeps every table at most half
   full, so a probe always reaches an empty slot. Plain C, no instruction-set assumptions. */

#include <stdint.h>
#include <string.h>

#define EMPTY (-1)

/* A set of tables, as ngram.py's `_CompiledTables` lays it out in one int64 array: `count` tables of `cap`
   slots each (a power of two), the j-th holding the n-grams of n = min_n + j. */
typedef struct {
    int64_t min_n, count, cap;
    int32_t *const *tables;
} ngram_tables;

/* A 64-bit hash of n tokens (a multiply-xorshift chain with a final mix: every token moves every bit). */
static inline uint64_t gram_hash(const int32_t *t, int64_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (int64_t j = 0; j < n; j++) {
        h ^= (uint32_t)t[j];
        h *= 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    }
    h *= 0x94D049BB133111EBull;
    return h ^ (h >> 29);
}

static inline int same_gram(const int32_t *a, const int32_t *b, int64_t n) {
    return memcmp(a, b, (size_t)n * sizeof(int32_t)) == 0;
}

/* Map the n-gram tokens[i-n .. i-1] to i: its slot if the n-gram is in the table, else an empty one. */
static inline void put(const int32_t *tokens, int64_t n, int32_t *table, uint64_t mask, int64_t i) {
    const int32_t *key = tokens + i - n;
    uint64_t s = gram_hash(key, n) & mask;
    for (;;) {
        int32_t p = table[s];
        if (p == EMPTY || same_gram(tokens + p - n, key, n)) {
            table[s] = (int32_t)i;
            return;
        }
        s = (s + 1) & mask;
    }
}

/* Index, in every table, each n-gram followed by a token at a position i in [max(start, n), end), in order:
   each ends mapped to its latest i. The caller guarantees cap >= 2 * end, so no table passes half full. */
void helexa_ngram_extend(const ngram_tables *t, const int32_t *tokens, int64_t start, int64_t end) {
    uint64_t mask = (uint64_t)t->cap - 1;
    for (int64_t j = 0; j < t->count; j++) {
        int64_t n = t->min_n + j;
        for (int64_t i = start > n ? start : n; i < end; i++)
            put(tokens, n, t->tables[j], mask, i);
    }
}

/* The position that followed the latest indexed occurrence of the longest suffix of `tail` (tail_len tokens)
   of n = min_n + count - 1 down to min_n tokens whose position is below `end`; -1 when there is none. An
   n-gram whose latest occurrence is at or past `end` is passed over for a shorter n (the index maps each
   n-gram to its latest occurrence only). */
int64_t helexa_ngram_lookup(const ngram_tables *t, const int32_t *tokens, const int32_t *tail, int64_t tail_len,
                            int64_t end) {
    uint64_t mask = (uint64_t)t->cap - 1;
    for (int64_t j = t->count - 1; j >= 0; j--) {
        int64_t n = t->min_n + j;
        if (n > tail_len)
            continue;
        const int32_t *key = tail + tail_len - n;
        const int32_t *table = t->tables[j];
        uint64_t s = gram_hash(key, n) & mask;
        for (;;) {
            int32_t p = table[s];
            if (p == EMPTY)
                break;
            if (same_gram(tokens + p - n, key, n)) {
                if (p < end)
                    return p;
                break;
            }
            s = (s + 1) & mask;
        }
    }
    return -1;
}
