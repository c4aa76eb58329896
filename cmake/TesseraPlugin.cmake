# Build helpers shared by the in-tree targets. The installed SDK ships its own copy of
# tessera_add_plugin() (sdk/cmake/TesseraSDKConfig.cmake.in) for out-of-tree plugins.

# A precompiled LibTorch header (TESSERA_PCH_HEADERS) as the object library `name`, compiled
# with the flags of the folder that adds it.
function(tessera_add_torch_pch name)
  add_library(${name} OBJECT "${PROJECT_SOURCE_DIR}/cmake/pch.cpp")
  target_link_libraries(${name} PUBLIC ${TORCH_LIBRARIES} OpenMP::OpenMP_CXX)
  target_precompile_headers(${name} PUBLIC ${TESSERA_PCH_HEADERS})
endfunction()

# Reuse the project's precompiled LibTorch header (default visibility): tessera_pch, or the one
# a folder names in TESSERA_TORCH_PCH (tests/: compiled at the tests' -O level, which GCC
# requires). It is compiled with -fPIC; GCC refuses it for -fPIE code, so executables compile as
# -fPIC too (same code).
function(tessera_use_torch_pch target)
  get_target_property(type ${target} TYPE)
  if(type STREQUAL "EXECUTABLE")
    set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE OFF)
    target_compile_options(${target} PRIVATE -fPIC)
  endif()
  if(NOT TESSERA_TORCH_PCH)
    set(TESSERA_TORCH_PCH tessera_pch)
  endif()
  target_precompile_headers(${target} REUSE_FROM ${TESSERA_TORCH_PCH})
endfunction()

# tessera_add_plugin(<name> SOURCES a.cpp ...) builds lib<name>.so as a MODULE into the
# build tree's plugin directory, linked to the SDK and core, exporting only its descriptor.
function(tessera_add_plugin name)
  cmake_parse_arguments(ARG "" "" "SOURCES;LIBRARIES" ${ARGN})
  add_library(${name} MODULE ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE tessera::core ${ARG_LIBRARIES})
  set_target_properties(${name} PROPERTIES PREFIX "lib"
    LIBRARY_OUTPUT_DIRECTORY "${TESSERA_PLUGIN_BUILD_DIR}"
    CXX_VISIBILITY_PRESET hidden VISIBILITY_INLINES_HIDDEN ON
    INSTALL_RPATH "$ORIGIN/../..")
  target_precompile_headers(${name} REUSE_FROM tessera_plugin_pch)
  install(TARGETS ${name} LIBRARY DESTINATION "${TESSERA_PLUGIN_INSTALL_DIR}")
endfunction()
