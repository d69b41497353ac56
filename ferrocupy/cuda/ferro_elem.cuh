// A kernel built for one element type: `T` is float, or with FERRO_BF16 defined the build's
// 16-bit half type (ferro_convert.cuh), and `E` its conversions.
#pragma once
#include "ferro_convert.cuh"

#ifdef FERRO_BF16
typedef u16 T;
#else
typedef float T;
#endif
typedef Elem<T> E;
