# Decide TESSERA_WITH_CUDA from TESSERA_CUDA (AUTO follows the LibTorch found).
set(TESSERA_WITH_CUDA 0)
if(TESSERA_CUDA STREQUAL "ON" OR (TESSERA_CUDA STREQUAL "AUTO" AND TARGET torch_cuda))
  if(NOT TARGET torch_cuda)
    message(FATAL_ERROR "TESSERA_CUDA=ON but the LibTorch found (${Torch_DIR}) has no CUDA")
  endif()
  set(TESSERA_WITH_CUDA 1)
endif()
message(STATUS "Tessera: CUDA ${TESSERA_WITH_CUDA}, LibTorch ${Torch_VERSION} at ${Torch_DIR}")
