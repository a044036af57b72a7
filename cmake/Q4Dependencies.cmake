# Finds every third-party dependency once, for all libraries.

# GPU architectures: one list for our kernels and LibTorch's CMake. Default: sm_90 (H100, H200),
# sm_100 (B200), sm_120 (RTX 50 series), sm_121 (DGX Spark GB10). -DCMAKE_CUDA_ARCHITECTURES=<list>
# replaces it (compute capabilities as CMake writes them: 90;120 or 90a); =native builds for the
# GPUs nvidia-smi lists. LibTorch's CMake ignores CMAKE_CUDA_ARCHITECTURES (it warns so), reads
# TORCH_CUDA_ARCH_LIST instead (else the environment variable of that name, else the local GPU)
# and adds its -gencode flags to CMAKE_CUDA_FLAGS, which our kernels compile with: so the list
# becomes TORCH_CUDA_ARCH_LIST before find_package(Torch) (9.0;10.0;12.0;12.1, with PTX of the
# highest for newer GPUs), unless -DTORCH_CUDA_ARCH_LIST is given; an environment value (set by
# some images for PyTorch extensions) does not narrow the default. No kernel uses sm_90a-only
# instructions (wgmma, setmaxnreg), so plain sm_90 code serves Hopper.
set(Q4_CUDA_ARCHITECTURES_DEFAULT "90;100;120;121")
set(_q4_archs_cached OFF)
if(DEFINED CACHE{CMAKE_CUDA_ARCHITECTURES})
  set(_q4_archs_cached ON)
  set(Q4_CUDA_ARCHS "${CMAKE_CUDA_ARCHITECTURES}")
else()
  set(Q4_CUDA_ARCHS "${Q4_CUDA_ARCHITECTURES_DEFAULT}")
endif()
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND Q4_CUDA_ARCHS STREQUAL "native")
  find_program(Q4_NVIDIA_SMI nvidia-smi)
  if(Q4_NVIDIA_SMI)
    execute_process(COMMAND ${Q4_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE _q4_caps RESULT_VARIABLE _q4_rc
                    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    string(REGEX REPLACE "[ \t\r\n]+" ";" _q4_caps "${_q4_caps}")
    if(_q4_rc EQUAL 0 AND _q4_caps MATCHES "^[0-9]+\\.[0-9]")
      list(REMOVE_DUPLICATES _q4_caps)
      set(TORCH_CUDA_ARCH_LIST "${_q4_caps}")
    endif()
  endif()
elseif(NOT DEFINED TORCH_CUDA_ARCH_LIST)
  set(_q4_torch_archs "")
  foreach(_arch IN LISTS Q4_CUDA_ARCHS)
    string(REGEX REPLACE "-real$" "" _arch "${_arch}")
    if(NOT _arch MATCHES "^([0-9]+)([0-9])([af]?)$")
      message(FATAL_ERROR "CMAKE_CUDA_ARCHITECTURES: '${_arch}' is not supported here; give "
                          "compute capabilities (e.g. 90;120) or native")
    endif()
    list(APPEND _q4_torch_archs "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
  endforeach()
  list(POP_BACK _q4_torch_archs _arch)
  if(NOT _arch MATCHES "[af]$")  # PTX of an sm_90a-like target runs on that GPU only
    string(APPEND _arch "+PTX")
  endif()
  list(APPEND _q4_torch_archs "${_arch}")
  set(TORCH_CUDA_ARCH_LIST "${_q4_torch_archs}")
endif()

find_package(Torch REQUIRED)
if(NOT _q4_archs_cached)
  # LibTorch's CMake enabled CUDA, and CMake cached its compiler's default architecture: drop
  # it, so that the next configure keeps the default list above.
  unset(CMAKE_CUDA_ARCHITECTURES CACHE)
endif()
find_package(yaml-cpp REQUIRED)
find_package(fmt REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(Threads REQUIRED)
if(Q4_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# CUDA: on when LibTorch was built with it (TORCH_CUDA_LIBRARIES set), or forced.
set(Q4_WITH_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR Q4_ENABLE_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(CMAKE_CUDA_FLAGS MATCHES "arch=compute_")
      # LibTorch's -gencode flags (from TORCH_CUDA_ARCH_LIST) are in CMAKE_CUDA_FLAGS: CMake adds
      # none of its own, so each architecture is compiled once.
      set(CMAKE_CUDA_ARCHITECTURES OFF)
    else()
      set(CMAKE_CUDA_ARCHITECTURES "${Q4_CUDA_ARCHS}")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(Q4_WITH_CUDA ON)
  elseif(Q4_ENABLE_CUDA)
    message(FATAL_ERROR "Q4_ENABLE_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "q4: LibTorch ${Torch_VERSION}, CUDA kernels: ${Q4_WITH_CUDA}")
if(Q4_WITH_CUDA)
  string(REGEX MATCHALL "arch=compute_[0-9a-z]+,code=[a-z_0-9]+" _q4_gencode "${CMAKE_CUDA_FLAGS}")
  message(STATUS "q4: CUDA architectures ${Q4_CUDA_ARCHS} (TORCH_CUDA_ARCH_LIST "
                 "'${TORCH_CUDA_ARCH_LIST}', environment '$ENV{TORCH_CUDA_ARCH_LIST}'): "
                 "${_q4_gencode}")
endif()

# PCRE2 and utf8proc (tokenizer): pkg-config first, plain find_library as fallback.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(PCRE2 QUIET IMPORTED_TARGET libpcre2-8)
  pkg_check_modules(UTF8PROC QUIET IMPORTED_TARGET libutf8proc)
endif()
# q4_find_c_library(NAME HEADER LIB): the imported target PkgConfig::NAME from a plain header and
# library search when pkg-config did not provide it.
function(q4_find_c_library name header lib)
  if(TARGET PkgConfig::${name})
    return()
  endif()
  find_path(Q4_${name}_INCLUDE ${header})
  find_library(Q4_${name}_LIB ${lib})
  if(Q4_${name}_INCLUDE AND Q4_${name}_LIB)
    add_library(q4_${name} INTERFACE)
    target_include_directories(q4_${name} INTERFACE ${Q4_${name}_INCLUDE})
    target_link_libraries(q4_${name} INTERFACE ${Q4_${name}_LIB})
    add_library(PkgConfig::${name} ALIAS q4_${name})
  endif()
endfunction()
q4_find_c_library(PCRE2 pcre2.h pcre2-8)
q4_find_c_library(UTF8PROC utf8proc.h utf8proc)

# NVTX3 is header-only and ships with the CUDA toolkit; without it the ranges compile to nothing.
set(Q4_HAVE_NVTX OFF)
if(Q4_WITH_CUDA)
  find_path(Q4_NVTX3_INCLUDE nvtx3/nvToolsExt.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  if(Q4_NVTX3_INCLUDE)
    set(Q4_HAVE_NVTX ON)
  endif()
endif()

# Warnings for our own code only.
add_library(q4_warnings INTERFACE)
target_compile_options(q4_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter -Wno-sign-compare>)

if(Q4_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
  if(Q4_FUZZ)  # libFuzzer's coverage in every object, so the fuzz targets reuse the libraries
    add_compile_options(-fsanitize=fuzzer-no-link)
  endif()
endif()

# Data-parallel process groups (trainer/src/distributed/distributed.cpp). Gloo (CPU): Debian's LibTorch 1.13
# uses the system libgloo (libgloo-dev); LibTorch wheels carry gloo inside libtorch_cpu and may
# ship its headers. NCCL (CUDA): LibTorch wheels link the nvidia-nccl wheel; its headers and
# library sit next to torch in site-packages.
set(Q4_HAVE_GLOO OFF)
# Only with the system library: a wheel's gloo symbols inside libtorch_cpu may not be exported.
find_path(Q4_GLOO_INCLUDE gloo/context.h HINTS ${TORCH_INCLUDE_DIRS})
find_library(Q4_GLOO_LIB gloo PATHS /usr/lib /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE})
if(Q4_GLOO_INCLUDE AND Q4_GLOO_LIB)
  set(Q4_HAVE_GLOO ON)
endif()
set(Q4_HAVE_NCCL OFF)
if(Q4_WITH_CUDA)
  get_filename_component(_q4_site "${Torch_DIR}/../../../.." ABSOLUTE)
  file(GLOB _q4_nccl_hints "${_q4_site}/nvidia/nccl/include" "${_q4_site}/nvidia/*/include")
  find_path(Q4_NCCL_INCLUDE nccl.h HINTS ${_q4_nccl_hints} ${CUDAToolkit_INCLUDE_DIRS})
  file(GLOB _q4_nccl_lib_hints "${_q4_site}/nvidia/nccl/lib" "${_q4_site}/nvidia/*/lib")
  find_library(Q4_NCCL_LIB NAMES nccl libnccl.so.2 HINTS ${_q4_nccl_lib_hints})
  if(Q4_NCCL_INCLUDE AND Q4_NCCL_LIB)
    set(Q4_HAVE_NCCL ON)
  endif()
endif()
message(STATUS "q4: process groups: gloo ${Q4_HAVE_GLOO}, nccl ${Q4_HAVE_NCCL}")
