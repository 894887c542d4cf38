// The thread count of the OpenMP runtime the kernels run on (libgomp, which Paddle's oneDNN uses
// too), for the engine's wide steps (fastdeploy/platforms/cpu_binding.py): plain C functions that
// ctypes calls. Paddle's own runtime (libiomp5) is a different one and is left as it is.
#include <omp.h>

extern "C" int fd_omp_get_max_threads() { return omp_get_max_threads(); }

// For the calling thread's next parallel regions (the engine's main thread starts them all).
extern "C" void fd_omp_set_num_threads(int n) { omp_set_num_threads(n); }
