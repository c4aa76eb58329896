# Process start-up. Debian's LibTorch brings ~285 shared libraries into every process (libtorch_cpu
# needs OpenCV, GDAL, Qt, FFmpeg...), and the dynamic loader resolves their ~140K symbol
# references at start by walking the global search list from its front, in breadth-first order:
# a lookup passes ~100 libraries, ~30% of the CPU a process spends starting (perf: do_lookup_x).
# The suite starts thousands of processes (every test, every `tessera` and rank it runs), and users
# start `tessera` for every command. Naming the libraries that answer the most lookups as the
# executables' first dependencies moves them to the front of that list (~35 passed a lookup).
#
# Measured, not guessed: a probe linked to LibTorch runs under LD_DEBUG=bindings, which says where
# each lookup ended; the order is used only once a probe linked with it binds every reference to
# a strong definition where it bound before (jemalloc's malloc, LibTorch's BLAS), weak ones
# (C++ inline code, a copy in each library) to any copy. The C and C++ runtimes keep their
# place (tessera links jemalloc ahead of them). Only
# libraries in the loader's default folders are named (an installed binary finds them as the
# probe did). Left out: sanitizer builds (their runtime must come first), non-glibc systems.
option(TESSERA_STARTUP_ORDER "Order the executables' libraries for a faster start (measured at configure time)" ON)

function(tessera_startup_order)
  set(flags "${CMAKE_CXX_FLAGS} ${CMAKE_EXE_LINKER_FLAGS}")
  if(NOT TESSERA_STARTUP_ORDER OR NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR flags MATCHES "-fsanitize")
    return()
  endif()
  set(key "${Torch_DIR};${Torch_VERSION};${CMAKE_CXX_COMPILER};${JEMALLOC_LIBRARY}")
  if(NOT DEFINED TESSERA_STARTUP_LIBRARIES OR NOT TESSERA_STARTUP_KEY STREQUAL key)
    set(dir "${CMAKE_BINARY_DIR}/startup-order")
    set(script "${PROJECT_SOURCE_DIR}/cmake/startup-order.sh")
    file(WRITE "${dir}/probe.cpp" "int main() { return 0; }\n")
    set(jemalloc)
    if(TESSERA_JEMALLOC AND JEMALLOC_LIBRARY)
      set(jemalloc -Wl,--push-state,--no-as-needed "${JEMALLOC_LIBRARY}" -Wl,--pop-state)
    endif()
    try_compile(built "${dir}/plain" SOURCES "${dir}/probe.cpp" LINK_LIBRARIES ${jemalloc} ${TORCH_LIBRARIES}
      COPY_FILE "${dir}/plain-probe")
    # What may be named: libraries of the loader's default folders, but for the C and C++ runtimes.
    set(folders "^(/usr)?/lib(/${CMAKE_LIBRARY_ARCHITECTURE})?/[^/]+$")
    set(runtimes "/(ld-linux[^/]*|lib(c|m|stdc\\+\\+|gcc_s|pthread|dl|rt|jemalloc)[.-][^/]*)$")
    set(libraries)
    set(ordered "")
    if(built)
      execute_process(COMMAND sh "${script}" providers "${dir}/plain-probe" "${dir}/bindings"
        OUTPUT_VARIABLE providers OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE status)
      string(REPLACE "\n" ";" providers "${providers}")
      foreach(library IN LISTS providers)
        if(status EQUAL 0 AND library MATCHES "${folders}" AND NOT library MATCHES "${runtimes}")
          list(APPEND libraries "${library}")
          list(LENGTH libraries count)
          if(count EQUAL 40)  # the rest answer ~20% of the lookups
            break()
          endif()
        endif()
      endforeach()
    endif()
    # Where a library now takes a strong definition from one it passed (OpenBLAS from the
    # libblas.so.3 that LibTorch binds its BLAS to), the passed one moves in front of it, or, when
    # it may not move (the C library), the library stays where it was. A few rounds settle it.
    foreach(round RANGE 4)
      if(NOT libraries)
        break()
      endif()
      try_compile(built "${dir}/ordered" SOURCES "${dir}/probe.cpp"
        LINK_OPTIONS -Wl,--push-state,--no-as-needed ${libraries} -Wl,--pop-state
        LINK_LIBRARIES ${jemalloc} ${TORCH_LIBRARIES} COPY_FILE "${dir}/ordered-probe")
      if(NOT built)
        break()
      endif()
      execute_process(COMMAND sh "${script}" same "${dir}/plain-probe" "${dir}/ordered-probe" "${dir}/bindings"
        OUTPUT_VARIABLE moved OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE status)
      if(status EQUAL 0)
        string(JOIN " " ordered -Wl,--push-state,--no-as-needed ${libraries} -Wl,--pop-state)
        break()
      endif()
      string(REPLACE "\n" ";" moved "${moved}")
      foreach(pair IN LISTS moved)
        separate_arguments(pair UNIX_COMMAND "${pair}")
        list(GET pair 0 taker)
        list(GET pair 1 owner)
        list(FIND libraries "${taker}" at)
        if(at LESS 0)
          continue()
        endif()
        list(REMOVE_ITEM libraries "${owner}")
        if(owner MATCHES "${folders}" AND NOT owner MATCHES "${runtimes}")
          list(FIND libraries "${taker}" at)
          list(INSERT libraries ${at} "${owner}")
        else()
          list(REMOVE_ITEM libraries "${taker}")
        endif()
      endforeach()
    endforeach()
    if(NOT ordered)
      message(STATUS "Startup order: not used (no order kept every strong definition where it was)")
    endif()
    set(TESSERA_STARTUP_LIBRARIES "${ordered}" CACHE INTERNAL "Link flags naming the libraries answering most lookups")
    set(TESSERA_STARTUP_KEY "${key}" CACHE INTERNAL "What TESSERA_STARTUP_LIBRARIES was measured for")
  endif()
  if(TESSERA_STARTUP_LIBRARIES)
    message(STATUS "Startup order: executables name first the libraries that answer most symbol lookups")
    set(CMAKE_EXE_LINKER_FLAGS "${CMAKE_EXE_LINKER_FLAGS} ${TESSERA_STARTUP_LIBRARIES}" PARENT_SCOPE)
  endif()
endfunction()
