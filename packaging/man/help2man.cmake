# Makes one gzipped manual page with help2man from PROGRAM --help and --version and INCLUDE.
#   cmake -DHELP2MAN=... -DGZIP=... -DPROGRAM=... -DSECTION=... -DINCLUDE=... -DOUTPUT=... -DVERSION=...
#         -P help2man.cmake
# help2man runs PROGRAM through a wrapper that spells a usage of "usage: PROGRAM ..." and lines
# "       PROGRAM ..." under it the way help2man reads a SYNOPSIS ("Usage: PROGRAM ...",
# "  or:  PROGRAM ..."). A PROGRAM without a working --version gets VERSION (the
# project's) instead of failing the build.
get_filename_component(name ${PROGRAM} NAME)
set(wrapper ${OUTPUT}.bin/${name})
file(WRITE ${wrapper} "#!/bin/sh\n"
  "if [ \"$1\" = --help ]; then\n"
  "  \"${PROGRAM}\" --help | sed -e '1s/^usage: /Usage: /' -e 's/^       ${name} /  or:  ${name} /'\n"
  "  exit\nfi\n"
  "exec \"${PROGRAM}\" \"$@\"\n")
file(CHMOD ${wrapper} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
execute_process(COMMAND ${PROGRAM} --version RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
set(args --no-info --section=${SECTION} --include=${INCLUDE} --output=${OUTPUT})
if(NOT rc EQUAL 0)
  message(WARNING "${name} --version failed: its manual page says version ${VERSION}")
  list(APPEND args --version-string=${VERSION})
endif()
execute_process(COMMAND ${HELP2MAN} ${args} ${wrapper} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "help2man ${PROGRAM} failed")
endif()
execute_process(COMMAND ${GZIP} -n -9 -f ${OUTPUT} RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "gzip ${OUTPUT} failed")
endif()
