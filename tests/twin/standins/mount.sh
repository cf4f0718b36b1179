#!/bin/sh
# Twin stand-in for mount(8), a shell script run in the caller's own mount namespace (a stand-in
# served by standind.py would mount in the server's). An ESP named by /dev/disk/by-uuid/<uuid>,
# as zz-proxmox-boot update_esp_func() mounts it, is the twin's directory
# /var/lib/twin/esp/<uuid> (tests/twin/standins/boot.py ESP_ROOT), bind-mounted; a missing one
# fails as mount does (exit 32). Everything else is the real mount.
if [ "$#" -eq 2 ]; then
	case "$1" in
	/dev/disk/by-uuid/*)
		esp="/var/lib/twin/esp/${1#/dev/disk/by-uuid/}"
		if [ ! -d "$esp" ]; then
			echo "mount: $2: special device $1 does not exist." >&2
			exit 32
		fi
		exec /usr/bin/mount --bind "$esp" "$2"
		;;
	esac
fi
exec /usr/bin/mount "$@"
