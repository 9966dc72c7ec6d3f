# fusedps_cc_test(NAME SOURCES file... LIBS lib... [DEFINITIONS def...] [ARGS arg...]
#                 LABELS label... [TIMEOUT seconds])
#
# A C++ test in one call: the executable NAME from SOURCES, linked with LIBS (privately), built
# with the project's warnings (FUSEDPS_WARNINGS: -Werror), with DEFINITIONS as private compile
# definitions; the ctest test NAME runs it with ARGS and carries LABELS (unit, integration,
# stress, gpu... : .ci/run and tests/sanitizers/label_targets.py pick tests by label) and, when
# given, a TIMEOUT in seconds. Anything else a test needs (another property, a dependency) goes
# in calls after it on the same NAME.
function(fusedps_cc_test name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "TIMEOUT" "SOURCES;LIBS;DEFINITIONS;ARGS;LABELS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "fusedps_cc_test(${name}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT arg_SOURCES OR NOT arg_LABELS)
    message(FATAL_ERROR "fusedps_cc_test(${name}): SOURCES and LABELS are required")
  endif()
  add_executable(${name} ${arg_SOURCES})
  target_link_libraries(${name} PRIVATE ${arg_LIBS})
  target_compile_options(${name} PRIVATE ${FUSEDPS_WARNINGS})
  if(arg_DEFINITIONS)
    target_compile_definitions(${name} PRIVATE ${arg_DEFINITIONS})
  endif()
  add_test(NAME ${name} COMMAND ${name} ${arg_ARGS})
  set_tests_properties(${name} PROPERTIES LABELS "${arg_LABELS}")
  if(arg_TIMEOUT)
    set_tests_properties(${name} PROPERTIES TIMEOUT ${arg_TIMEOUT})
  endif()
endfunction()
