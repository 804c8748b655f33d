/*
 * A stand-in for the NVIDIA driver library (libcuda.so.1) on machines that
 * have no GPU and no driver.
 *
 * sgl-kernel's PyPI wheel links libcuda.so.1, so `import sgl_kernel` fails
 * without a driver even though SGLang's CPU engine never touches the GPU. The
 * only driver symbol needed at load time is cuPointerGetAttribute; the rest
 * answer the usual probes with "there is no device", so that nothing is
 * tempted to use CUDA. Built by sglang_dflash.cpu.runtime with the system C
 * compiler and put on LD_LIBRARY_PATH by `sglang-dflash serve`.
 */
typedef int CUresult;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_INITIALIZED = 3, CUDA_ERROR_NO_DEVICE = 100,
       CUDA_ERROR_NOT_FOUND = 500 };

CUresult cuInit(unsigned int flags) { (void)flags; return CUDA_ERROR_NO_DEVICE; }

CUresult cuDriverGetVersion(int *version) {
  if (version) *version = 0;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  if (count) *count = 0;
  return CUDA_SUCCESS;
}

CUresult cuPointerGetAttribute(void *data, int attribute, unsigned long long ptr) {
  (void)data; (void)attribute; (void)ptr;
  return CUDA_ERROR_NOT_INITIALIZED;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version,
                          unsigned long long flags) {
  (void)symbol; (void)version; (void)flags;
  if (pfn) *pfn = 0;
  return CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status) {
  (void)symbol; (void)version; (void)flags;
  if (pfn) *pfn = 0;
  if (status) *status = 0;
  return CUDA_ERROR_NOT_FOUND;
}
