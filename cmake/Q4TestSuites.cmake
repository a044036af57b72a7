# Registers a gtest binary with ctest one gtest suite at a time (run after each link by
# q4_add_test, as cmake -P). A ctest test is a process start of a LibTorch binary (~0.3-0.5 s), so
# one per suite instead of one per case keeps that cost to a few dozen starts while ctest -j can
# still spread the suites. Each name ends with " (<binary>)", since two binaries may have a suite
# of the same name. Within a suite:
#   <Suite>.*          the cases, labels LABELS;
#   <Suite>.*/cuda     value-parameterised cases on the CUDA backend, labels LABELS + cuda (they
#                      skip without a GPU); a suite whose name holds "Cuda" is all CUDA;
#   <Suite>.<Case>     each case named in SLOW, alone, label slow (+ cuda for a CUDA case).
# Each test's COST is its time from COSTS (lines "<seconds> <ctest name>", tests/ctest_costs.txt;
# 1 for a test not listed): ctest -j starts the longest tests first, so that no core waits at the
# end for a long test that started last. (ctest's own record of the last run's times cannot serve:
# CMake before 3.26 reads a name only up to its first space.)
# Inputs (-D): EXE, OUT (the ctest file written), WORKDIR, LABELS, SLOW (comma-separated), COSTS.
cmake_minimum_required(VERSION 3.22)
execute_process(COMMAND "${EXE}" --gtest_list_tests OUTPUT_VARIABLE _out RESULT_VARIABLE _rc
  TIMEOUT 120)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "${EXE} --gtest_list_tests failed (${_rc}): ${_out}")
endif()
string(REPLACE "," ";" _labels "${LABELS}")
string(REPLACE "," ";" _slow "${SLOW}")
string(REPLACE ";" "," _out "${_out}")
string(REPLACE "\n" ";" _lines "${_out}")

set(_suites "")
foreach(_line IN LISTS _lines)
  if(_line MATCHES "^([A-Za-z0-9_/]+)\\.")
    set(_suite "${CMAKE_MATCH_1}")
    list(APPEND _suites "${_suite}")
    set(_cases_${_suite} "")
  elseif(_line MATCHES "^  ([A-Za-z0-9_/]+)")
    list(APPEND _cases_${_suite} "${CMAKE_MATCH_1}")
  endif()
endforeach()

set(_script "")
get_filename_component(_bin "${EXE}" NAME)
if(COSTS)
  file(STRINGS "${COSTS}" _cost_lines REGEX "^[0-9]+ ")
endif()
# One intra-op thread per test process (LibTorch's OpenMP pool and OpenBLAS): ctest -j N runs N
# tests at once, so their default N threads each would oversubscribe the cores (a busy OpenMP
# pool spins; the demo run costs three times the CPU that way). A test that wants threads sets
# them itself. And glibc's malloc asks for transparent huge pages for its heap
# (glibc.malloc.hugetlb=1, inherited by the q4train, q4dat, ... processes a test starts): most of
# a test process's time is page faults, LibTorch's static initialisation and the tiny runs'
# 151,936-wide logits, and huge pages take the unit and end-to-end tests from 877 to 535 CPU-s on
# 2 cores (docs/testing.md#process-starts). Without transparent huge pages, or with a glibc older
# than 2.35, the setting does nothing.
set(_env "OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1;GLIBC_TUNABLES=glibc.malloc.hugetlb=1")
macro(_q4_add name filter labels skip)
  set(_n "${name} (${_bin})")
  set(_cost 1)
  foreach(_c IN LISTS _cost_lines)
    string(FIND "${_c}" " " _sp)
    math(EXPR _sp "${_sp} + 1")
    string(SUBSTRING "${_c}" ${_sp} -1 _cname)
    if(_cname STREQUAL _n)
      string(REGEX MATCH "^[0-9]+" _cost "${_c}")
    endif()
  endforeach()
  string(APPEND _script "add_test([==[${_n}]==] \"${EXE}\" [==[--gtest_filter=${filter}]==])\n"
    "set_tests_properties([==[${_n}]==] PROPERTIES WORKING_DIRECTORY \"${WORKDIR}\" "
    "LABELS \"${labels}\" COST ${_cost} ENVIRONMENT \"${_env}\"")
  if(${skip})
    string(APPEND _script " SKIP_REGULAR_EXPRESSION \"\\\\[  SKIPPED \\\\]\"")
  endif()
  string(APPEND _script ")\n")
endmacro()

foreach(_suite IN LISTS _suites)
  set(_all_cuda OFF)
  if(_suite MATCHES "Cuda")
    set(_all_cuda ON)
  endif()
  set(_main "")
  set(_cuda "")
  set(_excluded "")
  foreach(_case IN LISTS _cases_${_suite})
    set(_is_cuda ${_all_cuda})
    if(_case MATCHES "/cuda$")
      set(_is_cuda ON)
    endif()
    if("${_suite}.${_case}" IN_LIST _slow)
      set(_l slow)
      if(_is_cuda)
        list(APPEND _l cuda)
      endif()
      _q4_add("${_suite}.${_case}" "${_suite}.${_case}" "${_l}" _is_cuda)
      list(APPEND _excluded "${_suite}.${_case}")
    elseif(_is_cuda AND NOT _all_cuda)
      list(APPEND _cuda "${_suite}.${_case}")
    else()
      list(APPEND _main "${_suite}.${_case}")
    endif()
  endforeach()
  set(_cuda_labels ${_labels} cuda)
  list(REMOVE_DUPLICATES _cuda_labels)
  if(_cuda)
    _q4_add("${_suite}.*/cuda" "${_suite}.*/cuda" "${_cuda_labels}" ON)
    list(APPEND _excluded "${_suite}.*/cuda")
  endif()
  if(_main)
    set(_filter "${_suite}.*")
    if(_excluded)
      list(JOIN _excluded ":" _minus)
      string(APPEND _filter ":-${_minus}")
    endif()
    if(_all_cuda)
      _q4_add("${_suite}.*" "${_filter}" "${_cuda_labels}" ON)
    else()
      _q4_add("${_suite}.*" "${_filter}" "${_labels}" OFF)
    endif()
  endif()
endforeach()
file(WRITE "${OUT}" "${_script}")
