from __future__ import annotations

from django.contrib import admin

from .models import Entry, Feed, ImportRun, TaskOutcome


class EntryInline(admin.TabularInline):  # type: ignore[type-arg]
    model = Entry
    extra = 0
    fields = ("title", "link", "published", "guid")
    readonly_fields = fields


@admin.register(Feed)
class FeedAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "url",
        "title",
        "last_imported_at",
        "imports",
        "entries_created",
        "fence",
    )
    search_fields = ("url", "title")
    readonly_fields = ("fence",)
    inlines = (EntryInline,)


@admin.register(Entry)
class EntryAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("title", "feed", "published", "updated")
    list_filter = ("feed",)
    search_fields = ("title", "guid")


@admin.register(ImportRun)
class ImportRunAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = (
        "feed_url",
        "task_name",
        "started",
        "finished",
        "pid",
        "entries_created",
    )


@admin.register(TaskOutcome)
class TaskOutcomeAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    list_display = ("task_name", "feed_url", "outcome")
    list_filter = ("outcome", "task_name")
