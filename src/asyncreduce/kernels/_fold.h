/* The C reductions of asyncreduce's native helpers (samehost/_mailbox_core.pyx and
   samehost/_named_core.pyx: a lane operation's fold of every rank's part;
   transport/_stream_core.pyx: a direct run's step of recursive doubling), which include it as
   "../kernels/_fold.h". One copy of the arithmetic, so all give numpy's bits: see
   _mailbox_core.pyx's docstring (built with -fwrapv and -ffp-contract=off, never -ffast-math).
   reduction.py next to it is the reference, in numpy, and the source of the codes below. */
#ifndef ASYNCREDUCE_FOLD_H
#define ASYNCREDUCE_FOLD_H

#include <stddef.h>
#include <stdint.h>

/* Copies of kernels/reduction.py's code table, which is the source: AR_<REDUCTION> is
   REDUCTION_CODES["<reduction>"], AR_F32 ... AR_I16 are DTYPES["float32" ... "int16"].code.
   Change a number there, never here alone; tests/test_fold_codes.py reads these two enums
   and fails on any code that differs from the table, or a name it does not know. */
enum { AR_SUM = 1, AR_AVG, AR_MAX, AR_MIN, AR_PROD, AR_BAND, AR_BOR, AR_BXOR };
enum { AR_F32 = 2, AR_F64 = 3, AR_I32 = 4, AR_I64 = 5, AR_U8 = 6, AR_I8 = 8, AR_I16 = 12 };

/* Three loops per type and reduction, over pointers that do not overlap, so the compiler
   may vectorize them: out = x (op) y, out = out (op) y, and out = y (op) out. */
#define AR_OP(T, NAME, EXPR) \
    static void ar_pair_##NAME(T *restrict out, const T *restrict x, const T *restrict y, ptrdiff_t n) \
    { for (ptrdiff_t i = 0; i < n; i++) { T a = x[i], b = y[i]; out[i] = (T)(EXPR); } } \
    static void ar_acc_##NAME(T *restrict out, const T *restrict y, ptrdiff_t n) \
    { for (ptrdiff_t i = 0; i < n; i++) { T a = out[i], b = y[i]; out[i] = (T)(EXPR); } } \
    static void ar_racc_##NAME(T *restrict out, const T *restrict y, ptrdiff_t n) \
    { for (ptrdiff_t i = 0; i < n; i++) { T a = y[i], b = out[i]; out[i] = (T)(EXPR); } }
/* NaN wins max and min, and a tie (-0.0 and 0.0) goes to the later operand, as in np.maximum */
#define AR_ARITH(T, S) AR_OP(T, S##_sum, a + b) AR_OP(T, S##_prod, a * b) \
    AR_OP(T, S##_max, (a > b || a != a) ? a : b) AR_OP(T, S##_min, (a < b || a != a) ? a : b)
#define AR_BITS(T, S) AR_OP(T, S##_band, a & b) AR_OP(T, S##_bor, a | b) AR_OP(T, S##_bxor, a ^ b)
AR_ARITH(float, f32) AR_ARITH(double, f64)
AR_ARITH(int8_t, i8) AR_ARITH(int16_t, i16) AR_ARITH(int32_t, i32) AR_ARITH(int64_t, i64)
AR_ARITH(uint8_t, u8)
AR_BITS(int8_t, i8) AR_BITS(int16_t, i16) AR_BITS(int32_t, i32) AR_BITS(int64_t, i64)
AR_BITS(uint8_t, u8)

#define AR_FOLD(T, NAME) do { \
        ptrdiff_t n_ = nbytes / (ptrdiff_t)sizeof(T); \
        ar_pair_##NAME((T *)out, (const T *)parts[0], (const T *)parts[1], n_); \
        for (int r_ = 2; r_ < world; r_++) ar_acc_##NAME((T *)out, (const T *)parts[r_], n_); \
    } while (0); break
#define AR_ARITH_CASES(T, S) \
    case AR_SUM: AR_FOLD(T, S##_sum); case AR_PROD: AR_FOLD(T, S##_prod); \
    case AR_MAX: AR_FOLD(T, S##_max); case AR_MIN: AR_FOLD(T, S##_min);
#define AR_INT_CASES(T, S) AR_ARITH_CASES(T, S) \
    case AR_BAND: AR_FOLD(T, S##_band); case AR_BOR: AR_FOLD(T, S##_bor); \
    case AR_BXOR: AR_FOLD(T, S##_bxor); default: return 0;
#define AR_FLOAT_CASES(T, S) AR_ARITH_CASES(T, S) \
    case AR_AVG: AR_FOLD(T, S##_sum); default: return 0;
#define AR_DIVIDE(T) do { \
        T *o_ = (T *)out; ptrdiff_t n_ = nbytes / (ptrdiff_t)sizeof(T); \
        for (ptrdiff_t i = 0; i < n_; i++) o_[i] = o_[i] / (T)world; \
    } while (0)

/* out = parts[0] (op) parts[1] (op) ... (world >= 2 parts of nbytes each, none of them
   out), then divided by world for avg; 0, out untouched, for what is not folded here */
static int ar_fold(int dtype, int op, void *out, uint8_t *const *parts, int world,
                   ptrdiff_t nbytes) {
    if (world < 2) return 0;
    switch (dtype) {
    case AR_F32: switch (op) { AR_FLOAT_CASES(float, f32) } if (op == AR_AVG) AR_DIVIDE(float); return 1;
    case AR_F64: switch (op) { AR_FLOAT_CASES(double, f64) } if (op == AR_AVG) AR_DIVIDE(double); return 1;
    case AR_I8: switch (op) { AR_INT_CASES(int8_t, i8) } return 1;
    case AR_I16: switch (op) { AR_INT_CASES(int16_t, i16) } return 1;
    case AR_I32: switch (op) { AR_INT_CASES(int32_t, i32) } return 1;
    case AR_I64: switch (op) { AR_INT_CASES(int64_t, i64) } return 1;
    case AR_U8: switch (op) { AR_INT_CASES(uint8_t, u8) } return 1;
    default: return 0;
    }
}

#define AR_COMBINE(T, NAME) do { \
        ptrdiff_t n_ = nbytes / (ptrdiff_t)sizeof(T); \
        if (incoming_first) ar_racc_##NAME((T *)acc, (const T *)incoming, n_); \
        else ar_acc_##NAME((T *)acc, (const T *)incoming, n_); \
    } while (0); return 1
#define AR_ARITH_COMBINE(T, S) \
    case AR_SUM: case AR_AVG: AR_COMBINE(T, S##_sum); case AR_PROD: AR_COMBINE(T, S##_prod); \
    case AR_MAX: AR_COMBINE(T, S##_max); case AR_MIN: AR_COMBINE(T, S##_min);
#define AR_INT_COMBINE(T, S) AR_ARITH_COMBINE(T, S) \
    case AR_BAND: AR_COMBINE(T, S##_band); case AR_BOR: AR_COMBINE(T, S##_bor); \
    case AR_BXOR: AR_COMBINE(T, S##_bxor); default: return 0;

/* The bytes of an element of a dtype ar_combine takes (0 for any other) */
static int ar_itemsize(int dtype) {
    switch (dtype) {
    case AR_F32: case AR_I32: return 4;
    case AR_F64: case AR_I64: return 8;
    case AR_I16: return 2;
    case AR_I8: case AR_U8: return 1;
    default: return 0;
    }
}

/* acc = acc (op) incoming, or incoming (op) acc, as reduction.combine (avg adds: the division
   comes once, at the end); 0, acc untouched, for what is not combined here */
static int ar_combine(int dtype, int op, void *acc, const void *incoming, ptrdiff_t nbytes,
                      int incoming_first) {
    switch (dtype) {
    case AR_F32: switch (op) { AR_ARITH_COMBINE(float, f32) default: return 0; }
    case AR_F64: switch (op) { AR_ARITH_COMBINE(double, f64) default: return 0; }
    case AR_I8: switch (op) { AR_INT_COMBINE(int8_t, i8) }
    case AR_I16: switch (op) { AR_INT_COMBINE(int16_t, i16) }
    case AR_I32: switch (op) { AR_INT_COMBINE(int32_t, i32) }
    case AR_I64: switch (op) { AR_INT_COMBINE(int64_t, i64) }
    case AR_U8: switch (op) { AR_INT_COMBINE(uint8_t, u8) }
    default: return 0;
    }
}

#endif
