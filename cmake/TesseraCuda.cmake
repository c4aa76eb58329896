# Decide TESSERA_WITH_CUDA from TESSERA_CUDA (AUTO follows the LibTorch found).
set(TESSERA_WITH_CUDA 0)
if(TESSERA_CUDA STREQUAL "ON" OR (TESSERA_CUDA STREQUAL "AUTO" AND TARGET torch_cuda))
  if(NOT TARGET torch_cuda)
    message(FATAL_ERROR "TESSERA_CUDA=ON but the LibTorch found (${Torch_DIR}) has no CUDA")
  endif()
  set(TESSERA_WITH_CUDA 1)
endif()
# The toolkit's CUDA kernels (toolkit/cuda) are compiled by nvcc: the language is enabled here, in
# the directory above every target that links them. nvcc from CUDACXX, else the toolkit's.
if(TESSERA_WITH_CUDA)
  find_package(CUDAToolkit REQUIRED)
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
    find_program(TESSERA_NVCC nvcc HINTS "${CUDAToolkit_BIN_DIR}" /usr/local/cuda/bin REQUIRED)
    set(CMAKE_CUDA_COMPILER "${TESSERA_NVCC}")
  endif()
  enable_language(CUDA)
endif()
message(STATUS "Tessera: CUDA ${TESSERA_WITH_CUDA}, LibTorch ${Torch_VERSION} at ${Torch_DIR}")
